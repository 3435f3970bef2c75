import pytest
import torch

from selfopd.data import load_examples
from selfopd.diagnostics.transfer import (AnswerLogprobs, NothingToTransfer, answer_logprobs, answer_tokens, closure,
                                          read_transfer_rows, transfer, transfer_line, write_transfer_rows)


def _rows(gaps, gains):
    return [AnswerLogprobs(f"p{i}", teacher=-5.0 + gap, start=-5.0, end=-5.0 + gain)
            for i, (gap, gain) in enumerate(zip(gaps, gains))]


def test_closure_and_transfer_on_a_hand_computed_case():
    trained = _rows([2.0, 4.0], [1.0, 3.0])  # closes (1 + 3) / (2 + 4) of the gap
    held_out = _rows([2.0, 0.0, 2.0], [0.5, 5.0, 0.5])  # the middle prompt's context does not help: left out
    assert closure(trained) == pytest.approx(4 / 6)
    assert closure(held_out) == pytest.approx(1 / 4)
    result = transfer(trained, held_out)
    assert result.trained.value == pytest.approx(4 / 6) and result.held_out.value == pytest.approx(1 / 4)
    assert result.ratio.value == pytest.approx((1 / 4) / (4 / 6))
    assert (result.trained.n, result.held_out.n, result.skipped) == (2, 2, 1)
    assert result.trained.low <= result.trained.value <= result.trained.high
    assert "held-out / trained" in transfer_line(result)  # every trained prompt gained: the ratio is read
    lost = transfer(_rows([2.0, 4.0, 3.0], [-1.0, -2.0, -1.5]), held_out)  # training lowered the answer's logprob
    assert lost.trained.high < 0 and "the ratio is not read" in transfer_line(lost)
    with pytest.raises(NothingToTransfer, match="held-out"):
        transfer(trained, _rows([0.0], [1.0]))
    # a larger min_gap leaves out the prompts whose context barely helps
    small = _rows([0.3, 4.0], [3.0, 1.0])  # the first prompt's 0.3-nat gap is "closed" 10 times over
    assert transfer(trained, small).held_out.value == pytest.approx(4.0 / 4.3)
    assert transfer(trained, small, min_gap=0.5).held_out.value == pytest.approx(1.0 / 4.0)
    assert transfer(trained, small, min_gap=0.5).skipped == 1
    with pytest.raises(NothingToTransfer, match="trained"):
        transfer(trained, small, min_gap=5.0)


def test_transfer_rows_round_trip(tmp_path):
    rows = (_rows([2.0, 4.0], [1.0, 3.0]), _rows([0.5], [-0.25]))
    write_transfer_rows(rows, tmp_path / "transfer.jsonl")
    assert read_transfer_rows(tmp_path / "transfer.jsonl") == rows


@pytest.mark.parametrize("answer", ["Truaholm", "57", "salamander"])
def test_the_answer_tokens_are_exactly_the_answer(smollm2_tokenizer, answer):
    text = f"The answer is {answer}."
    ids, mask = answer_tokens(smollm2_tokenizer, text, answer)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(ids)
    assert smollm2_tokenizer.decode([i for i, m in zip(ids, mask) if m]).strip() == answer


def test_answer_logprobs_are_the_models_own_over_the_answer_tokens(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfopd.diagnostics.context import Prompting
    from selfopd.engines.local import LocalEngine
    from selfopd.templating.templates import load_template

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = LocalEngine(model, tokenizer)
    examples = load_examples("kb:countries?entities=2&unseen=0")[:3]
    prompting = Prompting(tokenizer, load_template("student/plain"), load_template("teacher/fact_sheet"),
                          {e.id: e for e in examples})
    rows = answer_logprobs(examples, prompting, engine, engine, engine, batch_size=2)
    assert all(r.start == r.end for r in rows) and all(r.teacher != r.start for r in rows)
    example = examples[0]
    ids, mask = answer_tokens(tokenizer, f"The answer is {example.answer}.", example.answer)
    prompt = prompting.student_ids(example)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].double(), -1)
    expected = sum(float(logprobs[len(prompt) - 1 + t, ids[t]]) for t in range(len(ids)) if mask[t])
    assert rows[0].start == pytest.approx(expected, abs=1e-4)


def test_diagnose_reports_a_transfer_with_no_gap_and_keeps_the_rest(tmp_path, tiny_model_dir, capsys):
    """The student's own prompt as the teacher's context opens no gap on any prompt: the transfer
    is undefined, and the diagnosis says so instead of failing."""
    import json

    from selfopd.cli import main
    from selfopd.training.trainer import train
    from tests.training.test_trainer import _config

    run_dir = train(_config(tmp_path, tiny_model_dir, "run.steps=1", "run.name=no_gap", "teacher.template=teacher/empty"))
    assert main(["diagnose", str(run_dir), "--gap-items", "2", "--transfer-items", "4", "--heatmaps", "0"]) == 0
    assert "transfer of the teacher's advantage: not measured, no prompt whose" in capsys.readouterr().out
    summary = json.loads((run_dir / "diagnostics" / "summary.json").read_text())
    assert "nothing to transfer" in summary["transfer"]["not_measured"] and summary["illusion"]
    assert "reference answer: not measured, no prompt" in (run_dir / "diagnostics" / "report.md").read_text()
    trained, held_out = read_transfer_rows(run_dir / "diagnostics" / "transfer.jsonl")  # kept, to recompute under
    assert len(trained) == 4 and len(held_out) == 4  # another rule; here every gap is exactly 0
    assert all(row.teacher == row.start for row in trained + held_out)
