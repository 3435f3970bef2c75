"""Diagnostics on real runs of the packaged SmolLM2: saved rollouts, privileged gain against a
float64 reference, the wrong-context contrast, `selfopd diagnose`, and the notebooks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.image
import nbformat
import pytest
import torch
from nbclient import NotebookClient

from selfopd.cli import main
from selfopd.config import load_config
from selfopd.data import load_examples
from selfopd.diagnostics import (
    Prompting,
    RolloutRecord,
    annotate_records,
    context_contrast,
    privileged_gains,
    read_run_rollouts,
    wrong_example,
)
from selfopd.diagnostics.transfer import read_transfer_rows
from selfopd.diagnostics.transfer import transfer as recompute
from selfopd.engines.local import LocalEngine
from selfopd.data.example import Example
from selfopd.templating.templates import load_template
from selfopd.training.trainer import train

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DATA = "rg:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=1&size=200&seed=5"
SMALL_RUN = [
    f"data.spec={DATA}", "data.eval_size=8", "run.steps=2", "run.rollouts_to_save=4", "run.progress=false",
    "run.eval_every=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_tokens=16",
    "optim.micro_batch_prompts=2", "optim.lr=1e-5", "loss.lambda_rl=0", "eval.max_tokens=16", "eval.batch_size=8",
]


EPISODE_RUN = [
    "data.spec=rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2", "data.eval_size=4", "run.steps=1",
    "run.rollouts_to_save=4", "run.progress=false", "run.eval_every=0", "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2", "rollout.max_tokens=8", "rollout.environment=retry_feedback", "rollout.max_turns=3",
    "rollout.max_episode_tokens=80", "optim.micro_batch_prompts=1",
]


@pytest.fixture(scope="module")
def episode_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A 1-step run on episodes of the tiny random model: its answers are always wrong, so every episode
    takes several turns, with the verifier's feedback between them."""
    out = tmp_path_factory.mktemp("episode-runs")
    return train(load_config(None, [*EPISODE_RUN, f"model.student={tiny_model_dir}", f"run.out_dir={out}",
                                    "run.name=episodes"]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_dir, episode_run) -> dict[str, Path]:
    """Two 2-step self-distillation runs: the leaky and the clean reference-answer template (trained after
    the episode run, so the clean one stays the newest run of the notebooks' project)."""
    out = tmp_path_factory.mktemp("runs")
    made = {}
    for label, template in (("leaky", "teacher/answer_hint_leaky"), ("clean", "teacher/reference_answer")):
        config = load_config(None, [*SMALL_RUN, f"run.out_dir={out}", f"run.name={label}",
                                    f"teacher.template={template}"])
        made[label] = train(config)
    return made


@pytest.fixture(scope="module")
def engine(smollm2_model, smollm2_tokenizer):
    return LocalEngine(smollm2_model, smollm2_tokenizer, batch_size=8)


@pytest.fixture(scope="module")
def prompting(smollm2_tokenizer):
    """Prompts as the runs make them, with the leaky teacher."""
    return Prompting(smollm2_tokenizer, load_template("student/plain"), load_template("teacher/answer_hint_leaky"),
                     {e.id: e for e in load_examples(DATA)})


def test_saved_rollouts_hold_student_logprobs_and_advantage(runs):
    by_step = read_run_rollouts(runs["leaky"])
    assert list(by_step) == [1, 2] and all(len(records) == 4 for records in by_step.values())
    for record in by_step[1]:
        # lambda_rl = 0: the advantage is exactly teacher - student; step 1 sampled the trained weights.
        assert record.advantage == pytest.approx(record.opd_advantage, abs=1e-6)
        assert record.student_logprobs == pytest.approx(record.sampler_logprobs, abs=1e-4)
        assert any(abs(a) > 1e-3 for a in record.advantage)


def test_privileged_gain_equals_a_float64_reference(runs, engine, smollm2_model, smollm2_tokenizer, prompting):
    record = read_run_rollouts(runs["leaky"])[1][0]
    gains, _ = privileged_gains(engine, [record], prompting)
    teacher_prompt = prompting.teacher_ids(prompting.example(record.id), record.text)
    assert smollm2_tokenizer.decode(teacher_prompt).count("Hint: the correct final answer is") == 1
    model64 = type(smollm2_model).from_pretrained(smollm2_model.name_or_path, dtype=torch.float64).eval()

    def reference(prompt):
        ids = torch.tensor([prompt + record.completion_ids])
        with torch.no_grad():
            logprobs = model64(ids).logits[0, :-1].log_softmax(-1)
        targets = ids[0, 1:]
        return logprobs.gather(-1, targets[:, None])[:, 0][len(prompt) - 1 :].numpy()

    expected = reference(teacher_prompt) - reference(record.prompt_ids)
    assert gains[0] == pytest.approx(expected, abs=2e-4)
    assert abs(expected).max() > 0.05  # the hint changes the teacher's view


def answer_rollouts(prompting, examples) -> list[RolloutRecord]:
    """'The answer is X.' with the right X for each item, as exact token ids."""
    tokenizer, records = prompting.tokenizer, []
    for example in examples:
        ids = tokenizer.encode(f"The answer is {example.answer}.", add_special_tokens=False) + [tokenizer.eos_token_id]
        prompt = prompting.student_ids(example)
        zeros = [0.0] * len(ids)
        records.append(RolloutRecord(0, example.id, 0, prompt, ids, tokenizer.decode(ids), zeros, zeros, zeros, zeros,
                                     1.0, True, example.answer))
    return records


def test_leaky_teacher_follows_a_wrong_answer_and_the_empty_control_gains_nothing(engine, prompting):
    records = answer_rollouts(prompting, list(prompting.examples_by_id.values())[:6])
    gains, wrong = privileged_gains(engine, records, prompting)
    contrast = context_contrast(annotate_records(records, prompting), gains, wrong)
    assert contrast.correct_rollouts == 6 and contrast.follows_context == 1.0
    right, wrong_gain = contrast.mean_gain_correct["answer_copy"], contrast.mean_gain_wrong["answer_copy"]
    # The answer tokens gain with the true answer in context, lose with a wrong one, and the two
    # differ by more than a nat (the leak, not noise, moves the teacher).
    assert right > 0 > wrong_gain and right - wrong_gain > 1.0

    empty_gains, empty_wrong = privileged_gains(engine, records, prompting.with_teacher(load_template("teacher/empty")))
    assert all((g == 0).all() and (w == 0).all() for g, w in zip(empty_gains, empty_wrong))


def test_wrong_example_changes_only_the_privileged_context():
    item = Example("a", "What is 2 + 3?", "5", solution="2 + 3 = 5", hints=("add",), meta={"reasoning_gym": {}, "k": 1})
    other = Example("b", "Spell cat", "tac", solution="reverse it", hints=("reverse",))
    wrong = wrong_example(item, other)
    assert wrong.prompt == item.prompt and wrong.answer != "5" and int(wrong.answer) >= 0
    assert wrong.solution == "reverse it" and wrong.hints == ("reverse",) and wrong.meta == {"k": 1}
    assert wrong_example(item, other) == wrong  # seeded
    words = wrong_example(Example("c", "Capital of France?", "Paris"), Example("d", "x", "Rome"))
    assert words.answer == "Rome" and words.solution is None


def test_diagnose_writes_a_report_with_figures(runs, capsys):
    assert main(["diagnose", str(runs["leaky"]), "--gap-items", "6", "--heatmaps", "2", "--transfer-items", "6"]) == 0
    out = runs["leaky"] / "diagnostics"
    printed = capsys.readouterr().out
    assert "illusion score at step 1" in printed and str(out / "report.md") in printed
    report = (out / "report.md").read_text()
    for heading in ("## Verdict", "## Where the advantage sits", "## Over training", "## Wrong-context contrast",
                    "## Gap before training", "## Teachability, contrastive gain", "## Per-token heatmaps"):
        assert heading in report
    for link in [line.split("](")[1][:-1] for line in report.splitlines() if line.startswith("![")]:
        image = matplotlib.image.imread(out / link)
        assert image.shape[0] > 50 and image.shape[1] > 200, link
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["illusion"]) == {"1", "2"} and summary["at_start"]["gap"]["student"]["n"] == 6
    share = summary["illusion"]["1"]["share"]
    assert 0 <= share["low"] <= share["value"] <= share["high"] <= 1
    assert "<span" in (out / "heatmaps.html").read_text()
    assert "self teacher: all information (capability 0)" in report and "(figures/signals.png)" in report
    signals = [json.loads(line) for line in (out / "signals.jsonl").read_text().splitlines()]
    assert len(signals) == 4 and {row["step"] for row in signals} == {1}  # the first saved step's rollouts
    assert all(row["capability"] == [0.0] * len(row["tokens"]) for row in signals)
    mass = summary["signals"]["teacher_mass_on_student_top_k"]
    assert summary["signals"]["exact"] and 0 < mass["value"] < 1 and summary["signals"]["dopd_information_share"] is None
    assert "- Teacher prefers correct attempts" in report
    transfer = summary["transfer"]  # the run's final checkpoint against its start, 6 trained and 6 held-out items
    assert 0 < transfer["trained"]["n"] <= 6 and 0 < transfer["held_out"]["n"] <= 6
    rows = read_transfer_rows(out / "transfer.jsonl")  # what it was computed from, one row per prompt
    assert [len(part) for part in rows] == [6, 6] and recompute(*rows).ratio.value == transfer["ratio"]["value"]
    assert "Transfer of the teacher's advantage" in report and "held-out / trained" in printed
    preference = summary["teacher_prefers_correct"]
    assert preference is None or preference["low"] <= preference["value"] <= preference["high"]


def test_diagnose_an_episode_run_reports_its_turns_whatever_the_environments_ids_hold(episode_run, tmp_path):
    """The same run twice, one copy with wild values on the environment's ids of every saved rollout: the
    same numbers, a per-turn section, and heatmaps with the environment greyed and the turns labelled."""
    summaries = {}
    for label in ("saved", "altered"):
        run = shutil.copytree(episode_run, tmp_path / label)
        if label == "altered":
            path = next((run / "rollouts").glob("step_*.jsonl"))
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            for row in rows:
                for field, wild in (("advantage", 1e4), ("student_logprobs", -3e3), ("teacher_logprobs", 5e3)):
                    row[field] = [v if own else wild for v, own in zip(row[field], row["loss_mask"])]
            path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        assert main(["diagnose", str(run), "--no-model", "--heatmaps", "1"]) == 0
        out = run / "diagnostics"
        report = (out / "report.md").read_text()
        assert "## Turns of the episodes" in report and "| 1 | 2 | 4 |" in report  # every episode reached turn 2
        html = (out / "heatmaps.html").read_text()
        assert ">turn 2</span>" in html and ">environment</span>" in html and "e+03" not in html and "+10000" not in html
        summary = json.loads((out / "summary.json").read_text())
        assert summary["episodes"]["1"]["turns"]["value"] > 1 and 0 < summary["episodes"]["1"]["environment_share"] < 1
        summaries[label] = {key: value for key, value in summary.items() if key != "run"}
    assert summaries["saved"] == summaries["altered"]


def test_diagnose_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["diagnose", str(tmp_path), "--no-model"]) == 1
    assert "not a run folder" in capsys.readouterr().err


SMALL_NOTEBOOK = {"privileged_illusion.ipynb": "PROMPTS = 4\nGAP_ITEMS = 6"}  # sizes only: every path is its default


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_with_its_defaults(notebook, runs, episode_run, tmp_path):
    """Each notebook with its default parameters, run by Jupyter from notebooks/ of a project
    whose runs/ holds the two small runs (and, for the heatmaps, a run on episodes): it finds the
    project folder, the newest run and the newest run on episodes itself."""
    project = tmp_path / "project"
    (project / "notebooks").mkdir(parents=True)
    (project / "experiments" / "demo").mkdir(parents=True)
    shutil.copy(ROOT / "experiments" / "demo" / "demo.toml", project / "experiments" / "demo")
    (project / "runs").mkdir()
    for label in ("leaky", "clean"):  # clean trained last: the newest run
        (project / "runs" / label).symlink_to(runs[label])
    if notebook.name == "advantage_heatmaps.ipynb":
        (project / "runs" / "episodes").symlink_to(episode_run)
    nb = nbformat.read(notebook, as_version=4)
    (index,) = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    if notebook.name in SMALL_NOTEBOOK:  # as papermill injects values: a cell after the parameters cell
        nb.cells.insert(index + 1, nbformat.v4.new_code_cell(SMALL_NOTEBOOK[notebook.name]))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(project / "notebooks")}}).execute()
    images = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs if "image/png" in o.get("data", {})]
    assert images, f"{notebook.name} displayed no figure"
    default_out = {"advantage_heatmaps.ipynb": runs["clean"] / "notebook",
                   "privileged_illusion.ipynb": project / "runs" / "notebooks" / "privileged_illusion",
                   "compare_runs.ipynb": project / "runs" / "notebooks" / "compare_runs"}[notebook.name]
    assert list(default_out.glob("*.png")), f"{notebook.name} wrote no figure into {default_out}"
    if notebook.name == "advantage_heatmaps.ipynb":  # the episode of the episode run, drawn beside the clean run's
        assert (default_out / "episode.png").is_file()
        shown = "".join(o.get("data", {}).get("text/markdown", "") for cell in nb.cells if cell.cell_type == "code"
                        for o in cell.outputs)
        assert "| 2 | 4 |" in shown  # the per-turn table: all 4 episodes reached a second turn


def test_the_heatmap_notebook_says_what_is_missing(tmp_path):
    from selfopd.run.finder import check_run, newest_run

    with pytest.raises(FileNotFoundError, match="no runs under .*make demo"):
        newest_run(tmp_path / "runs")
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "config.toml").write_text("")
    (tmp_path / "runs" / "r" / "metrics.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="none of the 1 runs .* saved rollouts"):
        newest_run(tmp_path / "runs")
    with pytest.raises(FileNotFoundError, match="no saved rollouts"):
        check_run(tmp_path / "runs" / "r")
    with pytest.raises(FileNotFoundError, match="not a run folder"):
        check_run(tmp_path)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{notebook.name}: strip outputs before committing"
