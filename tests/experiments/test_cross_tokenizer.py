"""The cross-tokenizer experiment's student: built offline with its own tokenizer, loadable by
selfopd, and bridged to the packaged SmolLM2 (no shared ids, both chat templates pass)."""

from __future__ import annotations

import json

from experiments.cross_tokenizer.build_student import build_student, training_texts
from selfopd.config import DEMO_DATA
from selfopd.data import load_examples
from selfopd.data.split import split_examples
from selfopd.engines.build import load_model
from selfopd.templating.token_bridge import open_bridge


def test_the_student_is_built_from_training_text_only_and_bridges_to_smollm2(tmp_path, smollm2_tokenizer):
    _, held_out = split_examples(load_examples(DEMO_DATA), eval_size=200, seed=0)
    texts = set(training_texts())
    assert len(training_texts()) == 3800
    assert not {e.prompt for e in held_out} & {text.split("\n")[0] for text in texts}  # no held-out prompt is read
    folder = build_student(tmp_path / "student", steps=3, batch_size=4)
    summary = json.loads((folder / "pretraining.json").read_text())
    assert summary["steps"] == 3 and summary["parameters"] > 1_000_000
    model, tokenizer = load_model(folder, frozen=True)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|end|>")
    bridge = open_bridge(tokenizer, smollm2_tokenizer, 49152)
    assert not bridge.shared_ids and tokenizer.get_vocab() != smollm2_tokenizer.get_vocab()
    ids = tokenizer.encode("Ones: 4 + 1 = 5, write 5.\nSo 4 + 1 = 5.", add_special_tokens=False) + [bridge.student_end]
    bridged = bridge.completion(ids)
    assert bridged.problem is None and bridged.teacher_ids[-1] == smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
