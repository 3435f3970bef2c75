"""Tools for maintainers: the behaviour digest of a refactor, step time at two commits, the docs figures."""
