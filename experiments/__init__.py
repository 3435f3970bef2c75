"""The studies, benchmarks and tools of the repository (experiments/README.md): scripts run as
modules from the repository's root, `python -m experiments.STUDY.SCRIPT`, and import the
installed `selfopd` (or the tree's, where it is not installed)."""
