"""`selfopd slurm`: the batch script for several nodes. SLURM cannot run on this machine, so the script runs
under bash with stand-ins for SLURM's own commands (`scontrol`, `srun`) and for `getent` and `curl` on PATH,
each recording how it was called: the nodes split by role, the servers' and the trainer's command lines,
the resume of an existing run, and a preemption notice passed to the trainer alone, then a requeue."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfopd.config import ConfigError, load_config
from selfopd.serving.slurm import SlurmLayout, SlurmRun, slurm_script

ROOT = Path(__file__).resolve().parents[2]
SETS = ["engine.kind=vllm", "rollout.temperature=1.0", "engine.tensor_parallel_size=2", "run.name=big"]

STAND_INS = {
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$LOG"
if [[ $1 == show ]]; then printf 'gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n'; fi
""",
    "getent": """#!/bin/bash
echo "10.0.0.$(( ${#2} )) STREAM $2"
""",
    "curl": """#!/bin/bash
echo "curl $*" >> "$LOG"
""",
    "srun": """#!/bin/bash
echo "srun $*" >> "$LOG"
if [[ " $* " == *" torchrun "* ]]; then
  trap 'echo "trainer got TERM" >> "$LOG"; exit 1' TERM
  echo started > "$LOG.trainer"
  for i in $(seq 600); do sleep 0.1; done
  exit 0
fi
trap 'echo "a server got TERM" >> "$LOG"; exit 1' TERM
sleep 600 & wait
""",
}


def _script(tmp_path: Path, run_exists: bool, extra: tuple[str, ...] = ()) -> tuple[Path, dict]:
    sets = (*SETS, f"run.out_dir={tmp_path / 'runs'}", *extra)
    config = load_config(ROOT / "experiments/demo/demo.toml", list(sets))
    script = tmp_path / "job.sbatch"
    run = SlurmRun("experiments/demo/demo.toml", sets, "big", str(tmp_path / "runs" / "big"), config.teacher.kind)
    script.write_text(slurm_script(run, config.engine,
                                   SlurmLayout(trainer_nodes=2, student_nodes=1, gpus_per_node=8, notice_s=120)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if run_exists:
        (tmp_path / "runs" / "big").mkdir(parents=True)
        (tmp_path / "runs" / "big" / "config.toml").write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "log"),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-[a-d]", "SELFOPD_VLLM_API_KEY": "k" * 40}
    return script, env


def _log(tmp_path: Path) -> list[str]:
    return (tmp_path / "log").read_text().splitlines()


@pytest.mark.parametrize("teachers", [1, 2])
def test_the_script_splits_the_nodes_by_role_and_launches_each_its_part(tmp_path, teachers):
    """Two teacher servers (engine.teacher_servers) share the teacher node, on consecutive ports; every
    student server and the trainer get both URLs."""
    script, env = _script(tmp_path, run_exists=False, extra=(f"engine.teacher_servers={teachers}",))
    options = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
    assert options == ["#SBATCH --job-name=big", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1",
                       "#SBATCH --gpus-per-node=8", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue"]
    process = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    _wait_for(tmp_path / "log.trainer")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    time.sleep(0.2)
    log = _log(tmp_path)
    serves = [line for line in log if " selfopd serve " in line]
    assert len(serves) == 2
    students = [line for line in serves if "--nodelist=gpu-c" in line]
    (teacher,) = [line for line in serves if "--nodelist=gpu-d" in line]
    assert students and "engine.student_servers=4" in students[0] and "engine.student_gpus=0,1,2,3,4,5,6,7" in students[0]
    teacher_urls = ",".join(f"http://gpu-d:{8100 + i}" for i in range(teachers))
    assert f"engine.teacher_url={teacher_urls}" in students[0].split() and "engine.host=0.0.0.0" in students[0]
    urls = ",".join(f"http://gpu-c:{8100 + i}" for i in range(4))
    gpus = ",".join(str(gpu) for gpu in range(2 * teachers))  # TP 2 each
    assert f"engine.student_urls={urls}" in teacher and f"engine.teacher_gpus={gpus}" in teacher.split()
    (trainer,) = [line for line in log if " torchrun " in line]
    assert "--nodelist=gpu-a,gpu-b" in trainer and "--nnodes=2 --nproc_per_node=8" in trainer
    assert "--rdzv_endpoint=gpu-a:29500" in trainer and "engine.trainer_address=10.0.0.5" in trainer
    assert "-m selfopd train experiments/demo/demo.toml" in trainer and f"engine.student_urls={urls}" in trainer
    assert "engine.api_key_env=SELFOPD_VLLM_API_KEY" in trainer and "k" * 40 not in "\n".join(log)
    assert f"engine.teacher_url={teacher_urls}" in trainer.split()
    assert sum(line.startswith("curl -sf http://gpu-") for line in log) == 4 + teachers  # each server's /health


def test_a_notice_stops_the_trainer_alone_and_requeues_and_the_next_job_resumes(tmp_path):
    script, env = _script(tmp_path, run_exists=True)
    process = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    try:
        _wait_for(tmp_path / "log.trainer")
        time.sleep(0.5)
        os.kill(process.pid, signal.SIGUSR1)  # what --signal=B:USR1@120 sends: the batch shell alone
        assert process.wait(timeout=60) == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the servers' stand-ins, still up as real ones would be
    log = _log(tmp_path)
    assert "trainer got TERM" in log and "a server got TERM" not in log
    assert "scontrol requeue 4242" in log
    (trainer,) = [line for line in log if " torchrun " in line]
    assert f"-m selfopd train --resume {tmp_path / 'runs' / 'big'} " in trainer
    assert "experiments/demo/demo.toml" not in trainer.split("train --resume")[1]


def test_a_config_that_does_not_fit_the_layout_is_one_line():
    config = load_config(None, ["engine.kind=vllm", "rollout.temperature=1.0", "engine.tensor_parallel_size=3"])
    run = SlurmRun("c.toml", (), "run", "runs/run", "self")
    with pytest.raises(ConfigError, match=r"engine.tensor_parallel_size: 3 does not divide the 8 GPUs"):
        slurm_script(run, config.engine, SlurmLayout(1, 1, 8))
    with pytest.raises(ConfigError, match=r"engine.kind: 'local'"):
        slurm_script(run, load_config(None).engine, SlurmLayout(1, 1, 8))
    with pytest.raises(ConfigError, match=r"teacher.kind: 'frozen'"):
        slurm_script(SlurmRun("c.toml", (), "run", "runs/run", "frozen"), config.engine.__class__(kind="vllm"),
                     SlurmLayout(1, 1, 8))


def test_the_command_writes_a_script_bash_reads(tmp_path):
    out = tmp_path / "job.sbatch"
    result = subprocess.run([sys.executable, "-m", "selfopd", "slurm", "experiments/demo/demo.toml",
                             *(f"--set={s}" for s in SETS), "--trainer-nodes=2", "--student-nodes=1",
                             "--gpus-per-node=8", "--time=24:00:00", f"--out={out}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --time=24:00:00" in out.read_text()
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
