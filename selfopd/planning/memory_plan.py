"""How much GPU memory a run takes, per GPU, planned before anything loads: from the models'
config.json (never their weights), the layout ([engine], model.device, the FSDP world size) and
the rollout shape. `selfopd plan` and `selfopd train --show-config` print it (docs/memory-planner.md).

The trainer's parts: weights (fp32 master weights, or a LoRA base in its dtype), gradients and
AdamW state (of what trains; FSDP divides all three by its world size), the bf16 weight copies
autocast keeps for backward, the activations autograd saves (`ACTIVATION_BYTES`: counted with
`torch.autograd.graph.saved_tensors_hooks` on models of several shapes, tests/planning/
test_memory_plan.py), and the loss window: `LOSS_CHUNK` positions of each row's full-vocabulary
fp32 logits, a few tensors of them at once (`selfopd.engines.kernels`); in process, the sampling
and in-run eval KV caches and the teacher's scoring window. A vLLM server's parts are
`selfopd.planning.server_memory`'s. Estimates: within about 10% of what was measured
(docs/memory-planner.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3
LOSS_CHUNK = 256  # positions per row in one loss window (the kernels' chunk_size)
# (B, W, V) fp32 tensors alive at once in a loss window, by loss.divergence, read off selfopd.engines.kernels:
# a window's logits and their log-softmax (the gradient is then written in place); a divergence adds the
# teacher's log-probabilities and a mixture or probabilities.
WINDOW_TENSORS = {"sampled": 2, "topk_reverse_kl": 3, "reverse_kl": 4, "forward_kl": 4, "jsd": 4}
HEADROOM = 0.10  # a plan fits when its estimate plus this share of it fits: the estimates' error (docs)
SCORING_WINDOW_TENSORS = 2  # no grad: a window's logits and their log-softmax
# Bytes autograd saves per token and decoder layer, as coefficients of (hidden size, intermediate
# size, query width heads x head_dim, key/value width kv_heads x head_dim), by how the layer computes:
# fp32 weights; fp32 master weights under bf16 autocast; bf16 weights; a bf16 LoRA base with adapters
# on every linear layer. QK_NORM_BYTES: what Qwen3's per-head q/k norms add (of query, key width).
ACTIVATION_BYTES = {"float32": (21.0, 18.0, 10.0, 9.0), "autocast": (26.5, 8.0, 9.0, 0.5),
                    "bfloat16": (14.5, 9.0, 5.0, 4.5), "lora": (18.0, 9.5, 7.5, 5.0)}
QK_NORM_BYTES = {"float32": (8.0, 8.0), "autocast": (6.0, 6.0), "bfloat16": (6.0, 6.0), "lora": (4.0, 4.0)}
# A Gated DeltaNet layer (transformers' PyTorch path, without flash-linear-attention): its MLP as above,
# plus (bytes per unit of projection width, bytes per value head and position of its 64-token chunks).
LINEAR_BYTES = {"float32": (27.0, 30.0), "autocast": (16.0, 24.5), "bfloat16": (16.0, 24.5), "lora": (16.0, 24.5)}
FINAL_BYTES_PER_HIDDEN = 16  # per completion token: the final norm's saved tensors and the loss's fp32 hidden states
RESERVE_GIB = 1.0  # per GPU: the CUDA context and the allocator's slack, outside every estimate


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of one model, read off its config (the text config of a multimodal one)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # of the causal LM the trainer loads (a multimodal checkpoint's language model)
    embedding_params: int  # input embeddings, plus the head when it is not tied
    attention_layers: int  # layers with a KV cache
    linear_layers: int = 0  # Gated DeltaNet (linear attention) layers: a fixed state per sequence
    linear_state: int = 0  # elements of that state per sequence and layer (convolution + recurrent)
    linear_width: int = 0  # a linear layer's projection width (2 key + 2 value widths), for its activations
    linear_value_heads: int = 0
    qk_norm: bool = False
    # (module name, sum of in + out features over the layers) of the decoder's linear layers: LoRA's size
    linears: tuple[tuple[str, int], ...] = ()
    note: str = ""  # where its config.json came from, when not the hub cache or the folder named

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters of rank `rank` on the modules `targets` names ('all-linear': every one)."""
        return sum(rank * width for name, width in self.linears if "all-linear" in targets or name in targets)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> float:
        """Keys and values of one token over the attention layers, on one of `tp` GPUs."""
        return self.attention_layers * 2 * max(1, self.kv_heads // tp) * self.head_dim * dtype_bytes

    def state_bytes_per_sequence(self, dtype_bytes: int, tp: int = 1) -> float:
        return self.linear_layers * self.linear_state * dtype_bytes / tp

    def activation_bytes_per_token(self, scheme: str) -> float:
        """What autograd keeps of one token over all decoder layers (no checkpointing)."""
        a_h, a_i, a_q, a_kv = ACTIVATION_BYTES[scheme]
        n_q, n_kv = QK_NORM_BYTES[scheme] if self.qk_norm else (0.0, 0.0)
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = a_h * self.hidden + a_i * self.intermediate
        attention = mlp + (a_q + n_q) * q + (a_kv + n_kv) * kv
        per_width, per_head = LINEAR_BYTES[scheme]
        linear = mlp + per_width * self.linear_width + per_head * 64 * self.linear_value_heads
        return self.attention_layers * attention + self.linear_layers * linear


def read_model_config(spec: str, key: str, trust_remote_code: bool = False) -> Any:
    """The transformers config of a packaged model, folder or hub id: config.json only (a hub id
    reads the hub cache, or downloads that one file). A ConfigError naming the spec otherwise."""
    from transformers import AutoConfig

    from selfopd.config.checks import ConfigError
    from selfopd.core.models import PACKAGED_MODELS, resolve_model

    try:
        folder = resolve_model(spec) if spec in PACKAGED_MODELS else spec
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as error:  # no such folder, no config.json, offline without a cached copy, ...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(key, f"{spec}: cannot read its config.json for the memory plan ({first})") from None


def planned_shape(spec: str, key: str, trust_remote_code: bool = False) -> ModelShape:
    """The shape of model `spec` for the plan: a hub id whose config.json ships with selfopd
    (`selfopd.planning.published_configs`) is read from the Hugging Face cache, else from that copy,
    never the network; anything else as `read_model_config` reads it."""
    from pathlib import Path

    from selfopd.planning.published_configs import planning_config

    published = None if Path(spec).exists() else planning_config(spec, trust_remote_code)
    if published is None:
        return model_shape(read_model_config(spec, key, trust_remote_code), spec)
    config, note = published
    return dataclasses.replace(model_shape(config, spec), note=note)


def model_shape(config: Any, name: str = "") -> ModelShape:
    """The shape of the causal LM of `config` (a multimodal config's text model); parameters counted
    on the meta device, so any architecture transformers knows is counted exactly, without memory."""
    import torch
    from transformers import AutoModelForCausalLM

    text = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(text)
    params = sum(p.numel() for p in model.parameters())
    embeddings = {id(p): p.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
                  if m is not None for p in m.parameters()}
    widths: dict[str, int] = {}
    for module_name, module in model.get_decoder().named_modules():
        if isinstance(module, torch.nn.Linear):
            short = module_name.rsplit(".", 1)[-1]
            widths[short] = widths.get(short, 0) + module.in_features + module.out_features
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    linear = sum(kind == "linear_attention" for kind in types)
    key_width = getattr(text, "linear_num_key_heads", 0) * getattr(text, "linear_key_head_dim", 0)
    value_heads = getattr(text, "linear_num_value_heads", 0)
    value_width = value_heads * getattr(text, "linear_value_head_dim", 0)
    conv = (2 * key_width + value_width) * (getattr(text, "linear_conv_kernel_dim", 4) - 1)
    heads = text.num_attention_heads
    return ModelShape(
        name=name or getattr(text, "model_type", "model"), layers=len(types), hidden=text.hidden_size,
        intermediate=text.intermediate_size, heads=heads, kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size, params=params,
        embedding_params=sum(embeddings.values()), attention_layers=len(types) - linear, linear_layers=linear,
        linear_state=conv + value_heads * getattr(text, "linear_key_head_dim", 0) * getattr(text, "linear_value_head_dim", 0),
        linear_width=2 * key_width + 2 * value_width, linear_value_heads=value_heads,
        qk_norm=any(n.endswith("q_norm.weight") for n, _ in model.named_parameters()), linears=tuple(widths.items()))


@dataclass(frozen=True)
class Part:
    """One line of the plan: what holds memory, its bytes, and how the number was made."""

    what: str
    bytes: float
    how: str = ""


@dataclass
class Process:
    """A trainer rank or a vLLM server on its GPU(s): its parts per GPU, in phases that do not overlap
    (the peak is the largest phase over the parts every phase holds)."""

    name: str
    gpus: tuple[int, ...]  # () on a CPU
    held: list[Part] = field(default_factory=list)
    phases: dict[str, list[Part]] = field(default_factory=dict)
    budget: float | None = None  # a server's engine.gpu_memory_utilization of its GPU, bytes
    budget_how: str = ""
    outside: list[Part] = field(default_factory=list)  # a server's memory beyond its budget (prompt_logprobs)
    loads: dict[str, Any] = field(default_factory=dict)  # a server's phase -> server_memory.Load

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(x.bytes for x in self.phases[p])) if self.phases else ""

    @property
    def peak(self) -> float:
        return sum(p.bytes for p in self.held) + sum(p.bytes for p in self.phases.get(self.peak_phase, []))


@dataclass(frozen=True)
class Inputs:
    """Everything the plan depends on, resolved from a config (`plan_inputs`) or written out in tests."""

    student: ModelShape
    teacher: ModelShape | None  # a teacher with weights of its own (external, or a frozen copy); None: none held
    teacher_kind: str
    dtype: str  # resolved: 'float32' or 'bfloat16'
    on_gpu: bool
    engine: str  # engine.kind
    teacher_in_process: bool
    world: int  # FSDP ranks of the trainer
    lora_rank: int
    lora_params: int
    checkpointing: bool
    prompts_per_step: int
    samples: int
    max_tokens: int
    prompt_tokens: int
    micro_batch_prompts: int
    divergence: str
    engine_batch: int  # engine.batch_size: rows per in-process sampling batch
    eval_prompts: int = 0  # eval.batch_size: prompts per in-run eval batch (0: no in-run eval planned)
    eval_samples: int = 1
    eval_max_tokens: int = 0


def scheme(inputs: Inputs) -> str:
    if inputs.lora_rank:
        return "lora" if inputs.dtype == "bfloat16" else "float32"
    return "autocast" if inputs.dtype == "bfloat16" else "float32"


def trainer_process(inputs: Inputs, name: str, gpus: tuple[int, ...]) -> Process:
    """One trainer rank: held weights and optimizer state, then the training phase (activations and
    loss window) and, in process, the sampling and scoring phases."""
    s, world, bf16 = inputs.student, inputs.world, inputs.dtype == "bfloat16"
    trainable = inputs.lora_params if inputs.lora_rank else s.params
    base_bytes = 2 if (inputs.lora_rank and bf16) else 4
    proc = Process(name, gpus)
    weights = s.params * base_bytes / world + (inputs.lora_params * 4 / world if inputs.lora_rank else 0)
    what = ("LoRA base in " + inputs.dtype + " + fp32 adapters") if inputs.lora_rank else "fp32 master weights"
    proc.held += [Part("weights", weights, what + (f", 1/{world} (FSDP)" if world > 1 else "")),
                  Part("AdamW state", trainable * 8 / world, f"2 x fp32 of {_count(trainable)} trained")]
    if inputs.teacher is not None:
        t_bytes = 4 if inputs.teacher_kind in ("frozen", "ema") else (2 if bf16 else 4)
        proc.held.append(Part("teacher weights", inputs.teacher.params * t_bytes / world,
                              f"{inputs.teacher_kind} teacher in process, {8 * t_bytes}-bit"))
    proc.phases["train"] = _training(inputs, trainable)
    if inputs.engine == "local":
        proc.phases["sample"] = [_hf_cache(inputs, inputs.prompts_per_step * inputs.samples, inputs.max_tokens,
                                           "sampling KV cache")]
        if inputs.eval_prompts:
            proc.phases["eval"] = [_hf_cache(inputs, -(-inputs.eval_prompts // inputs.world) * inputs.world
                                             * inputs.eval_samples, inputs.eval_max_tokens, "in-run eval KV cache")]
    if inputs.teacher_in_process:
        proc.phases["score"] = [_scoring_window(inputs)]
    return proc


def _training(inputs: Inputs, trainable: int) -> list[Part]:
    s, world = inputs.student, inputs.world
    rows = inputs.micro_batch_prompts * inputs.samples
    completion = rows * inputs.max_tokens
    one_pass = inputs.checkpointing or bool(s.linear_layers)  # no shared prompt cache: each row's prompt again
    tokens = rows * inputs.prompt_tokens + completion if one_pass else \
        inputs.micro_batch_prompts * inputs.prompt_tokens + completion
    kind = scheme(inputs)
    per_token = s.activation_bytes_per_token(kind)
    parts = [Part("gradients", trainable * 4 / world, "fp32, as the weights they update")]
    if kind == "autocast":  # autocast keeps each layer's bf16 weight copy for backward (not with checkpointing)
        layer_params = s.params - s.embedding_params
        parts.append(Part("bf16 weight copies", 0 if inputs.checkpointing else layer_params * 2,
                          "autocast's, kept for backward" if not inputs.checkpointing else "freed (checkpointing)"))
    if inputs.checkpointing:
        residual = 4 if kind in ("float32", "autocast") else 2
        act = tokens * (s.layers * s.hidden * residual + per_token / s.layers)
        how = f"{_count(tokens)} tokens: each layer's input, one layer recomputed"
    else:
        act, how = tokens * per_token, f"{_count(tokens)} tokens x {per_token / 2**20:.2f} MiB"
    parts.append(Part("activations", act, how + f" ({inputs.micro_batch_prompts} prompts x {inputs.samples} samples)"))
    parts.append(Part("final hidden states", completion * s.hidden * FINAL_BYTES_PER_HIDDEN, "fp32, completion tokens"))
    positions = min(LOSS_CHUNK * rows, completion)
    count = WINDOW_TENSORS[inputs.divergence]
    parts.append(Part("loss window", positions * s.vocab * 4 * count,
                      f"{count} x {_count(positions)} positions x {_count(s.vocab)} vocab, fp32 ({inputs.divergence})"))
    return parts


def _hf_cache(inputs: Inputs, rows: int, max_tokens: int, what: str) -> Part:
    """In-process sampling of `rows` rows over all ranks (rollouts, or the in-run eval's prompts x samples):
    transformers' cache of at most engine.batch_size of a rank's rows at prompt + max_tokens."""
    s, dtype_bytes = inputs.student, 2 if inputs.dtype == "bfloat16" else 4
    rows = min(inputs.engine_batch, rows // inputs.world)
    length = inputs.prompt_tokens + max_tokens
    cache = rows * (length * s.kv_bytes_per_token(dtype_bytes) + s.state_bytes_per_sequence(dtype_bytes))
    return Part(what, cache, f"{rows} rows x {length} tokens, in process")


def _scoring_window(inputs: Inputs) -> Part:
    """An in-process teacher scores in the trainer's micro-batches (selfopd.training.teacher)."""
    s = inputs.teacher or inputs.student
    rows = inputs.micro_batch_prompts * inputs.samples
    positions = min(LOSS_CHUNK * rows, rows * inputs.max_tokens)
    return Part("scoring window", positions * s.vocab * 4 * SCORING_WINDOW_TENSORS,
                f"{SCORING_WINDOW_TENSORS} x {_count(positions)} positions x {_count(s.vocab)} vocab, no grad")


def _count(n: float) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(int(n))


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"



