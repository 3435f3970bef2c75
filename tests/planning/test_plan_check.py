"""`selfopd train` on GPUs checks the memory plan before the run folder is made and before any weights
load (engine.check_memory_plan); the machine's GPUs are faked here as the planner tests fake them."""

from __future__ import annotations

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.config.auto import Machine
from selfopd.config.bundles import PlanSettings
from selfopd.planning.plan_check import memory_plan_refusal
from tests.cli.test_cli import DEMO_CONFIG

GPU = ("Test GPU", 0.001)  # (name, GiB) of GPU 0: nothing fits


def demo(model_dir, tmp_path, *overrides: str):
    return load_config(DEMO_CONFIG, [f"model.student={model_dir}", "model.device=cuda", f"run.out_dir={tmp_path}",
                                     "run.name=planned", *overrides])


def planned(model_dir, tmp_path, *overrides: str) -> PlanSettings:
    return PlanSettings.of(demo(model_dir, tmp_path, *overrides))


def test_train_on_gpus_refuses_a_plan_that_does_not_fit_before_the_run_folder_or_any_weights(
        tiny_model_dir, tmp_path, monkeypatch):
    from selfopd.planning import memory_fit
    from selfopd.training import trainer

    monkeypatch.setattr(Machine, "here", staticmethod(lambda: Machine(cuda=True, gpu_count=1)))
    monkeypatch.setattr(memory_fit, "detected_gpu", lambda: GPU)

    def no_weights(*args, **kwargs):
        raise AssertionError("the run was built: weights would load")

    monkeypatch.setattr(trainer, "build_run", no_weights)
    with pytest.raises(ConfigError) as error:
        trainer.train(demo(tiny_model_dir, tmp_path))
    message = str(error.value)
    assert message.startswith("engine.check_memory_plan: the memory plan does not fit: GPU 0 (Test GPU, 0.0 GiB) "
                              "needs ") and "\n" not in message
    assert "model.gradient_checkpointing=true (" in message  # the settings to try, as selfopd plan names them
    assert message.endswith("(selfopd plan prints the whole plan; engine.check_memory_plan = false starts without "
                            "this check)")
    assert not (tmp_path / "planned").exists()


def test_the_setting_turns_the_check_off_and_a_cpu_is_never_checked(tiny_model_dir, tmp_path):
    gpu_machine = Machine(cuda=True, gpu_count=1)
    assert memory_plan_refusal(planned(tiny_model_dir, tmp_path), gpu_machine, GPU, 1).startswith(
        "the memory plan does not fit: GPU 0 (Test GPU, 0.0 GiB) needs ")
    assert memory_plan_refusal(planned(tiny_model_dir, tmp_path, "engine.check_memory_plan=false"), gpu_machine, GPU,
                               1) is None
    assert memory_plan_refusal(planned(tiny_model_dir, tmp_path, "model.device=cpu"), gpu_machine, GPU, 1) is None
    assert memory_plan_refusal(planned(tiny_model_dir, tmp_path), Machine(cuda=False), None, 1) is None


def test_a_model_the_planner_cannot_build_starts_without_the_check_and_says_so(tiny_model_dir, tmp_path, monkeypatch,
                                                                              capsys):
    from selfopd.planning import memory_fit
    from selfopd.planning.plan_check import check_memory_plan

    def unbuildable(*args, **kwargs):
        raise RuntimeError("no meta-device build for this architecture\nsecond line")

    monkeypatch.setattr(memory_fit, "plan_run", unbuildable)
    check_memory_plan(planned(tiny_model_dir, tmp_path), 1, Machine(cuda=True, gpu_count=1), GPU)
    assert capsys.readouterr().err == ("warning: engine.check_memory_plan: no memory plan for this run (RuntimeError: no "
                                       "meta-device build for this architecture); starting without it\n")
