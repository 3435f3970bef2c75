"""What the 2-process tests share: a small training config whose step splits into whole
micro-batches over 2 ranks, and `torchrun` on this machine's CPU (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def config_file(tmp_path: Path, model: Path, micro_batch_prompts: int = 2, dtype: str = "float32") -> Path:
    """4 prompts x 2 samples: each rank takes 2 prompts (4 rows, one generation batch of
    engine.batch_size = 4, so one process draws the same randomness row by row), in
    2 // micro_batch_prompts micro-batches."""
    path = tmp_path / "two.toml"
    path.write_text(f"""
[run]
out_dir = "{tmp_path / 'runs'}"
steps = 2
eval_every = 0
progress = false
[model]
student = "{model}"
threads = 1
dtype = "{dtype}"
[data]
spec = "rg:chain_sum?min_terms=2&max_terms=2&size=60&seed=2"
eval_size = 5
[rollout]
prompts_per_step = 4
samples_per_prompt = 2
max_tokens = 6
[loss]
lambda_rl = 1.0
[optim]
micro_batch_prompts = {micro_batch_prompts}
lr = 1e-4
[eval]
max_tokens = 6
batch_size = 4
[engine]
batch_size = 4
""")
    return path


def torchrun(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node 2 ARGS` from the repository root, with `env` added to the
    environment; fails the test on error unless not `check`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0 or not check, result.stdout[-3000:] + result.stderr[-5000:]
    return result
