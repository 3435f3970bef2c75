#!/usr/bin/env bash
# The prepared GPU checks (never run by CI), from a copy of the tree with no `pip install` of
# selfopd: PYTHONPATH=. and `python -m` import it from the tree. Arguments go to gpu_check.py:
#
#   bash experiments/benchmarks/gpu_check.sh --out $OUT/gpu_check.json   # trainer: one GPU, torch + transformers
#   bash experiments/benchmarks/gpu_check.sh --dry-run                    # its plumbing, in seconds
#   bash experiments/benchmarks/gpu_check.sh vllm                         # NCCL push into vLLM: 2+ GPUs, vLLM
#   bash experiments/benchmarks/gpu_check.sh scale --out $OUT/gpu_scale_probe.json  # 16 x 4 x 512 tokens: gpu_scale_probe.py
#
# Stops itself after 9 min 30 s (the trainer check starts no case after 7 minutes) or, for the
# vLLM check and the scale mode, 8 minutes. PYTHON chooses the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
module=gpu_check limit=570
if [[ "${1:-}" == "vllm" ]]; then limit=480; fi
if [[ "${1:-}" == "scale" ]]; then shift; module=gpu_scale_probe limit=480; fi
exec timeout --kill-after=30 "$limit" "${PYTHON:-python3}" -m "experiments.benchmarks.$module" "$@"
