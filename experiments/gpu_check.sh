#!/usr/bin/env bash
# Prepared GPU check (never run by CI): NCCL weight sync into student and teacher vLLM
# servers, and rollout/scoring throughput. Needs one CUDA GPU, `pip install vllm` and
# `pip install -e .`. Stops itself after 8 minutes. Arguments go to gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
exec timeout --kill-after=30 480 python experiments/gpu_check.py "$@"
