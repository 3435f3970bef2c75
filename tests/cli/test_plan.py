"""`selfopd plan` and the plan `selfopd train --show-config` prints."""

from __future__ import annotations

import tomllib

from selfopd.cli import main
from tests.cli.test_cli import DEMO_CONFIG


def test_plan_prints_the_memory_per_gpu(capsys, tiny_model_dir):
    assert main(["plan", str(DEMO_CONFIG), "--set", f"model.student={tiny_model_dir}", "--set", "model.device=cuda",
                 "--gpu-memory-gib", "141", "--gpu-name", "NVIDIA H200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("memory plan (estimates, docs/memory-planner.md): student ")
    assert "bfloat16" in out  # model.dtype = 'auto' on a GPU
    for part in ("weights", "AdamW state", "gradients", "activations", "loss window"):
        assert f"    {part} " in out
    assert "    GPU 0: " in out and "DOES NOT FIT" not in out


def test_plan_that_cannot_fit_is_one_line_naming_gpu_need_and_what_helps(capsys, tiny_model_dir):
    assert main(["plan", str(DEMO_CONFIG), "--set", f"model.student={tiny_model_dir}", "--set", "model.device=cuda",
                 "--gpu-memory-gib", "0.001", "--gpu-name", "Test GPU"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("selfopd: error: the memory plan does not fit: GPU 0 (Test GPU, 0.0 GiB) needs ")
    assert "combine: model.gradient_checkpointing=true (" in err and "model.lora_rank=16 (" in err


def test_plan_of_a_model_that_cannot_be_read_names_the_key(capsys, tmp_path):
    assert main(["plan", "--set", f"model.student={tmp_path / 'missing'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("selfopd: error: model.student: ") and err.count("\n") == 1


def test_show_config_prints_the_plan_as_comments_and_still_loads(capsys, tmp_path, tiny_model_dir):
    assert main(["train", str(DEMO_CONFIG), "--set", f"model.student={tiny_model_dir}", "--show-config"]) == 0
    out = capsys.readouterr().out
    assert "\n# memory plan (estimates, docs/memory-planner.md): student " in out
    assert "#   trainer (CPU memory): peak " in out  # no GPU here: planned, not checked
    assert tomllib.loads(out)["model"]["student"] == str(tiny_model_dir)
    assert main(["train", str(DEMO_CONFIG), "--set", f"model.student={tmp_path / 'missing'}", "--show-config"]) == 0
    assert "\n# memory plan: not made here: model.student: " in capsys.readouterr().out
