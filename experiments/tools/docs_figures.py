"""The documentation's figures from one run: the README's per-token advantage heatmap and an
executed copy of notebooks/advantage_heatmaps.ipynb rendered to HTML.

    python -m experiments.tools.docs_figures RUN_DIR                 # into runs/docs-figures/
    python -m experiments.tools.docs_figures RUN_DIR --out docs      # refresh the shipped copies

The notebook runs as Jupyter would from notebooks/, with RUN_DIR injected after its
parameters cell (as papermill does); the heatmap is the step's rollout with the largest
total |advantage| among the correct ones of the run's first saved step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def heatmap(run_dir: Path, path: Path) -> Path:
    from selfopd.config import load_config
    from selfopd.core.heatmaps import plot_token_heatmap
    from selfopd.data import load_examples
    from selfopd.diagnostics import annotate_records, read_run_rollouts, run_prompting

    config = load_config(run_dir / "config.toml")
    prompting = run_prompting(run_dir, config, load_examples(config.data.spec))
    by_step = read_run_rollouts(run_dir)
    step = min(by_step)
    rollouts = annotate_records(by_step[step], prompting)
    chosen = max([r for r in rollouts if r.record.correct] or rollouts, key=lambda r: abs(r.advantage).sum())
    verdict = "correct" if chosen.record.correct else "wrong"
    plot_token_heatmap(chosen.pieces.pieces, chosen.advantage, path, label="teacher - student logprob (nats)",
                       title=f"{prompting.teacher_template.name} teacher, step {step}: a {verdict} answer to "
                             f"{prompting.example(chosen.record.id).prompt!r}")
    return path


def notebook_html(run_dir: Path, path: Path) -> Path:
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    source = ROOT / "notebooks" / "advantage_heatmaps.ipynb"
    nb = nbformat.read(source, as_version=4)
    (index,) = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    run = run_dir.resolve().relative_to(ROOT) if run_dir.resolve().is_relative_to(ROOT) else run_dir.resolve()
    injected = nbformat.v4.new_code_cell(f"# injected parameters\nRUN_DIR = {str(run)!r}")
    injected.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(index + 1, injected)
    NotebookClient(nb, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(source.parent)}}).execute()
    for cell in nb.cells:  # tqdm's note that ipywidgets is not installed says nothing about the run
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (o.get("name") == "stderr" and "TqdmWarning" in o.get("text", ""))]
    html, _ = HTMLExporter(embed_images=True).from_notebook_node(nb)
    path.write_text(html)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run folder with saved rollouts")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "docs-figures",
                        help="writes OUT/images/advantage_heatmap.png and OUT/notebooks/advantage_heatmaps.html")
    args = parser.parse_args()
    for folder in ("images", "notebooks"):
        (args.out / folder).mkdir(parents=True, exist_ok=True)
    print(f"wrote {heatmap(args.run, args.out / 'images' / 'advantage_heatmap.png')}")
    print(f"wrote {notebook_html(args.run, args.out / 'notebooks' / 'advantage_heatmaps.html')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
