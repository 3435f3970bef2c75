"""The sections of a training config that say where and how the run computes: `[model]`
(the student, its device, precision, attention kernel, gradient checkpointing, LoRA) and
`[engine]` (who samples and scores: in process, vLLM servers on their GPUs, or vLLM
colocated in the trainer). Part of `selfopd.config`, which re-exports every name here."""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import ClassVar, Literal

from selfopd.config.revisions import revision_problem
from selfopd.config.server_args import server_args_problem
from selfopd.config.settings import (MAX_BATCH, MAX_SECONDS, MAX_TOKENS, MAX_WEIGHT, Section, TableValue,
                                     check_printable, fail, setting)

DType = Literal["auto", "float32", "bfloat16"]
EngineKind = Literal["local", "vllm", "vllm_colocate"]
TeacherEngine = Literal["vllm", "local"]
VLLM_KINDS = ("vllm", "vllm_colocate")
AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3"]
WeightSyncKind = Literal["auto", "gloo", "nccl"]
Switch = Literal["auto", "on", "off"]
# apply_chat_template's own arguments: selfopd sets these itself, so a template argument cannot.
CHAT_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                     "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                     "truncation", "max_length", "return_tensors", "return_dict",
                                     "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class ModelConfig(Section):
    SECTION: ClassVar[str] = "model"
    student: str = setting("smollm2-135m-instruct", "The student: a packaged model name, a local folder or a hub id.")
    revision: str = setting(
        "", "Hub revision of model.student when it is a hub id (a branch, tag or commit hash; '' = the hub's "
        "default branch): its one download fetches that revision, and every load of the student's weights "
        "(trainer, 'self'/'frozen'/'ema' teachers, vLLM servers) reads that snapshot's folder.")
    dtype: DType = setting(
        "auto", "Compute dtype. 'auto': 'bfloat16' when the trainer is on a CUDA GPU (float32 with LoRA and vLLM "
        "engines, which refuse bf16), 'float32' on a CPU; resolved when the config loads, and --show-config says "
        "why. 'bfloat16' trains with fp32 master weights and fp32 AdamW state, forward and "
        "backward in bf16 (autocast): a bf16 weight cannot take an update below 2^-8 of itself (lr 1e-6 steps "
        "vanish). Frozen teachers and vLLM servers then hold bf16 weights.")
    device: str = setting(
        "auto", "Where the trainer and in-process engines run: 'auto' (cuda when there is a GPU, under torchrun the "
        "rank's local GPU; else cpu), 'cpu', 'cuda' or 'cuda:N'.")
    attn_implementation: AttnImplementation = setting(
        "auto", "Attention kernel: 'auto' is flash_attention_2 on a GPU when the flash-attn package is installed, "
        "else 'sdpa'.")
    gradient_checkpointing: bool = setting(
        False, "Recompute each decoder layer's activations in backward: less memory, about a third more compute.")
    compile_layers: bool = setting(
        False, "torch.compile each decoder layer of the trained student, for forwards with gradients (sampling and "
        "scoring stay eager): layers share one compiled graph (one each with the shared prompt's KV cache), so "
        "elementwise work is fused in forward and backward. The first steps compile (13 s for SmolLM2 on 2 CPU "
        "cores); fp32 sums are reordered (the loss moves by ~1e-6 relative). "
        "Under torchrun each rank compiles its FSDP2 layers (tested on the CPU). Not yet run on a GPU. "
        "docs/results/benchmarks.md")
    lora_rank: int = setting(0, "LoRA rank (peft); 0 trains every weight. With LoRA a 'frozen' teacher is the "
                             "base model with the adapters disabled: no second copy in memory.", ge=0, most=65536)
    lora_alpha: float = setting(32.0, "LoRA alpha: the adapter's update is scaled by lora_alpha / lora_rank.", gt=0,
                                most=MAX_WEIGHT)
    lora_dropout: float = setting(0.0, "Dropout on the LoRA input.", ge=0, lt=1)
    lora_targets: tuple[str, ...] = setting(
        ("all-linear",), "Modules that get adapters: names as peft's target_modules ('all-linear': every linear "
        "layer but the output head).")
    lora_bf16_servers: bool = setting(
        False, "LoRA with model.dtype = 'bfloat16' and vLLM engines: the servers take W + dW rounded to bf16, as OPSD's "
        "code pushes its merged adapters to its bf16 vLLM. Off: refused, since an update far below bf16's resolution "
        "of W rounds away and the servers then sample close to the base model (the logprob probe still checks each "
        "push within probe.bf16_tolerance).")
    chat_template_kwargs: dict[str, TableValue] = setting(
        {}, "Extra arguments of the student's chat template, e.g. {enable_thinking = false} (Qwen3 and Qwen3.5 think "
        "by default; false makes their generation prompt end with an empty <think></think> block). Used wherever "
        "selfopd applies the student's chat template: training prompts, evaluation, checks, diagnostics, SFT. --set "
        "model.chat_template_kwargs=enable_thinking=false,name=value. docs/templates.md")
    threads: int = setting(0, "Torch CPU threads (0: torch's default).", ge=0, most=4096)
    trust_remote_code: bool = setting(
        False, "Run Python code shipped with a model folder or hub repo (its own architecture): passed to every "
        "transformers load and to vLLM (--trust-remote-code). Only for models whose code you trust.",
        guarded="it runs the Python files of the run's models")

    def __post_init__(self) -> None:
        super().__post_init__()
        self._non_empty("student")
        if (problem := revision_problem(self.student, self.revision)) is not None:
            fail(self._key("revision"), problem)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            fail(self._key("device"), f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        check_template_kwargs(self._key("chat_template_kwargs"), self.chat_template_kwargs)
        if self.lora_rank and not self.lora_targets:
            fail(self._key("lora_targets"), "must name at least one module when lora_rank > 0")

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0


def check_template_kwargs(key: str, kwargs: dict[str, TableValue]) -> None:
    """Refuse a chat-template argument that is one of apply_chat_template's own."""
    for name in kwargs:
        if name in CHAT_TEMPLATE_ARGUMENTS:
            fail(f"{key}.{name}", "is an argument selfopd passes to apply_chat_template itself, not a template "
                 "variable")


@dataclass(frozen=True)
class EngineConfig(Section):
    SECTION: ClassVar[str] = "engine"
    kind: EngineKind = setting(
        "local", "Who samples and scores: 'local' is in-process transformers; 'vllm' uses vLLM servers; "
        "'vllm_colocate' runs vLLM in the trainer's process on the trainer's GPU (one GPU).",
        guarded="it starts vLLM servers")
    batch_size: int = setting(
        64, "local: sequences per sampling or scoring forward of the training engines (memory vs speed).", ge=1,
        most=MAX_BATCH)
    packed_sampling: bool = setting(
        False, "local, fp32 on a CPU: the student samples through MKL's packed matrix products (each weight packed "
        "once per sampling batch instead of on every product): about 1.25x faster sampling of 8 rows on 2 cores, "
        "the same policy up to fp32 summation order. Evals and scoring are unchanged.")
    compiled_sampling: bool = setting(
        False, "local: the student samples with a static KV cache and a compiled decode step (torch.compile through "
        "transformers' generate; replayed as a CUDA graph on a GPU), the same draws as eager decoding. The first "
        "sampling call of each batch size compiles (about 40 s for SmolLM2 on 2 CPU cores); prompts are padded to a "
        "multiple of 64 tokens so later steps reuse it. Combines with engine.packed_sampling. Not under torchrun.")
    student_urls: str = setting(
        "", "vllm: comma-separated URLs of running student servers (several serve one model); empty: selfopd launches one.",
        guarded="requests and the API key go to these hosts")
    teacher_url: str = setting(
        "", "vllm: URL of a running teacher server, or comma-separated URLs of replicas (each request to the one "
        "with the fewest tokens in flight; they must agree on a probe within 0.05 nats at start); empty: selfopd "
        "launches one (self, frozen or external teacher).",
        guarded="requests and the API key go to these hosts")
    teacher_engine: TeacherEngine = setting(
        "vllm", "vllm: who scores the teacher. 'vllm': a server (launched, or engine.teacher_url). 'local': the "
        "trainer's process, as with engine.kind = 'local' (a 'self' teacher is the trainer's own module, so nothing "
        "is pushed to it): the student servers sample, and no teacher server is launched. It lifts the limits of a "
        "vLLM teacher: full-vocabulary losses and temperatures other than 1 are allowed. docs/async.md",
        guarded="it starts a teacher server")
    host: str = setting(
        "127.0.0.1", "vllm: address launched servers bind to (127.0.0.1: this machine only). Another address needs "
        "engine.api_key_env: every route of a launched server but /health requires the key.",
        guarded="it decides who can reach the servers selfopd launches")
    port: int = setting(
        8100, "vllm: the first launched server's port; student server i takes port + i, teacher server j the port "
        "after the launched students' + j.", ge=1, le=65535,
        guarded="it opens ports")
    max_model_len: int = setting(2048, "vllm: launched servers' context length; must hold prompt + completion + 1.",
                                 ge=16, most=MAX_TOKENS)
    weight_sync: WeightSyncKind = setting(
        "auto", "vllm: the collective that carries the weight push to the servers (vLLM's weight-transfer routes, "
        "selfopd's engine in the servers): 'gloo' (CPU memory, any machine), 'nccl' (GPU to GPU), 'auto': nccl "
        "when CUDA is there. Pushes are verified by per-tensor digests either way (engine.verify_every).")
    sync_port: int = setting(
        0, "vllm: TCP port of the weight push's rendezvous on the trainer (engine.trainer_address); several groups "
        "take the ports after it. 0: a free port (set one to open it in a firewall).", ge=0, le=65535,
        guarded="it opens a port")
    sync_timeout_s: float = setting(
        60.0, "vllm: seconds the weight push may wait for one step of it (joining the group, a broadcast, a "
        "server's load) before the run stops, naming the server.", gt=0, most=MAX_SECONDS)
    sync_buffer_mb: int = setting(
        512, "vllm: size of the packed chunks the weight push broadcasts (each server holds about one while loading).",
        ge=1, most=2**20)
    verify_every: int = setting(
        1, "vllm, vllm_colocate: verify the weight push by per-tensor digests every k-th push (1: every push). k > 1 saves the "
        "verification's time (58% of a push on a 2-core CPU, docs/results/benchmarks.md) on k - 1 pushes of k, at a price: a corrupted or partial "
        "load goes unnoticed for up to k - 1 steps (the logprob probe still runs after every push). The first push "
        "of a run or of a --resume, and a push after a failed or interrupted one, are always verified.",
        ge=1, most=2**20)
    student_servers: int = setting(1, "vllm: student servers to launch (each on its own GPUs when student_gpus is set).",
                                   ge=1, most=1024)
    student_gpus: str = setting(
        "", "vllm on GPU: comma-separated GPU indices for the launched student servers, tensor_parallel_size per "
        "server in order (e.g. '1,2' for two servers of TP 1). Empty: vLLM's default placement.")
    teacher_servers: int = setting(
        1, "vllm: teacher servers to launch, replicas of one teacher (each on its own GPUs when teacher_gpus is set); "
        "each scoring request goes to the one with the fewest tokens in flight.", ge=1, most=1024)
    teacher_gpus: str = setting(
        "", "vllm on GPU: comma-separated GPU indices for the launched teacher servers, the teacher's tensor-parallel "
        "size per server in order.")
    tensor_parallel_size: int = setting(1, "vllm: GPUs per launched student server (tensor parallelism).", ge=1,
                                        most=1024)
    teacher_tensor_parallel_size: int = setting(
        0, "vllm: GPUs of the launched teacher server (tensor parallelism); 0: engine.tensor_parallel_size.", ge=0,
        most=1024)
    sleep_mode: bool = setting(
        True, "vllm_colocate: put vLLM to sleep (weights and KV cache off the GPU) while the trainer runs its "
        "backward and optimizer step.")
    trainer_address: str = setting(
        "127.0.0.1", "vllm: the address at which the servers reach this trainer's weight-push group (its TCP "
        "rendezvous on engine.sync_port).",
        guarded="the weight push listens there")
    compile: Switch = setting(
        "auto", "vllm: torch.compile and CUDA graphs in launched servers; 'auto' is on with a GPU, off on CPU (minutes to start).")
    gpu_memory_utilization: float = setting(
        0.0, "vllm on GPU: share of GPU memory each launched server may take. 0: from the layout (a server alone on "
        "its GPUs 0.9; servers sharing a GPU split 0.9, less 0.5 where the trainer is; vllm_colocate 0.4).",
        ge=0, le=1)
    check_memory_plan: bool = setting(
        True, "on GPU: `selfopd train` plans the run's memory per GPU before the run folder is made and any weights "
        "load (`selfopd plan` on this machine: the models' config.json, prompts assumed 256 tokens) and refuses in "
        "one line, naming the settings that fit, when a GPU cannot hold its part. false: start without the check. "
        "On a CPU it does nothing.")
    cpu_kv_cache_gb: int = setting(1, "vllm on CPU: KV cache size of each launched server, GiB.", ge=1, most=65536)
    extra_server_args: str = setting(
        "", "vllm: more command-line arguments for launched servers (shell syntax): only flags known not to load code, "
        "open an address or change the model served (scheduling, memory, kernels, logging; the list is in "
        "docs/security.md), e.g. '--max-num-seqs 8 --kv-cache-dtype fp8'.",
        guarded="its flags reach the servers selfopd starts")
    startup_timeout_s: float = setting(900.0, "vllm: seconds to wait for launched servers to answer /health.", ge=1,
                                       most=MAX_SECONDS)
    request_timeout_s: float = setting(
        0.0, "vllm: seconds before one request times out (it is then retried, generation starting again). 0: a "
        "ceiling that scales with the work (selfopd.serving.liveness), while each server's /health is "
        "polled: a server that stops answering fails the step within a minute, a slow live one is waited for.",
        ge=0, most=MAX_SECONDS)
    retries: int = setting(3, "vllm: retries, with backoff, of a request that fails to connect, times out or gets a 5xx.",
                           ge=0, most=100)
    max_concurrency: int = setting(64, "vllm: most requests in flight per engine.", ge=1, most=MAX_BATCH)
    api_key_env: str = setting(
        "", "vllm: name of an environment variable holding the servers' API key (the key itself never goes in a "
        "config): launched servers require it on every route but /health, every request sends it. Empty: each "
        "launch generates a key that only the launching process knows (`selfopd serve` writes it to a file).",
        guarded="it names an environment variable whose value is sent as a key")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("student_urls", "teacher_url"):
            for url in self.urls(name):
                if not url.startswith(("http://", "https://")):
                    fail(self._key(name), f"expected http://HOST:PORT, got {url!r}")
        if len(set(self.urls("teacher_url"))) != len(self.urls("teacher_url")):
            fail(self._key("teacher_url"), "names a replica twice")
        for name in ("packed_sampling", "compiled_sampling"):
            if getattr(self, name) and self.kind != "local":
                fail(self._key(name), f"is for the in-process sampler (engine.kind = 'local'); engine.kind is "
                     f"{self.kind!r}")
        if self.teacher_engine == "local" and self.kind != "vllm":
            fail(self._key("teacher_engine"), f"'local' is for engine.kind = 'vllm' (vLLM samples, the trainer scores); "
                 f"engine.kind is {self.kind!r}")
        if self.teacher_engine == "local":
            for name in ("teacher_url", "teacher_gpus"):
                if getattr(self, name).strip():
                    fail(self._key(name), "is for a teacher server; with engine.teacher_engine = 'local' the trainer "
                         "scores the teacher (on model.device): leave it empty")
        self._check_launched_ports()
        self._check_server_args()
        self._check_distinct_servers()
        if not self.api_key_env and not is_loopback(self.host):
            fail(self._key("host"), f"{self.host!r} is not a loopback address: launched servers would answer the "
                 "network; set engine.api_key_env to the name of an environment variable holding their API key")
        if self.api_key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env):
            # The value is not echoed: it may be the key itself, pasted by mistake.
            fail(self._key("api_key_env"), "must be the NAME of an environment variable holding the key (letters, "
                 "digits and _), not the key itself")
        if self.api_key_env and not re.search(r"KEY|TOKEN|SECRET|PASSWORD", self.api_key_env.upper()):
            fail(self._key("api_key_env"), f"{self.api_key_env!r} does not name a secret: its value would be sent to "
                 "servers as their key; name a variable that says it holds one (its name contains KEY, TOKEN, SECRET "
                 "or PASSWORD, e.g. SELFOPD_VLLM_API_KEY)")
        for name in ("student_gpus", "teacher_gpus"):
            for gpu in getattr(self, name).split(","):
                if gpu.strip() and not gpu.strip().isdigit():
                    fail(self._key(name), f"expected comma-separated GPU indices such as '1,2', got {gpu.strip()!r}")
        if self.student_gpus.strip() and len(self.gpus("student_gpus")) != self.student_servers * self.tensor_parallel_size:
            fail(self._key("student_gpus"), f"names {len(self.gpus('student_gpus'))} GPUs; engine.student_servers "
                 f"({self.student_servers}) x engine.tensor_parallel_size ({self.tensor_parallel_size}) = "
                 f"{self.student_servers * self.tensor_parallel_size} are needed")
        if self.teacher_gpus.strip() and len(self.gpus("teacher_gpus")) != self.teacher_servers * self.teacher_parallel_size():
            size_key = "teacher_tensor_parallel_size" if self.teacher_tensor_parallel_size else "tensor_parallel_size"
            fail(self._key("teacher_gpus"), f"names {len(self.gpus('teacher_gpus'))} GPUs; engine.teacher_servers "
                 f"({self.teacher_servers}) x engine.{size_key} ({self.teacher_parallel_size()}) = "
                 f"{self.teacher_servers * self.teacher_parallel_size()} are needed")

    def _check_launched_ports(self) -> None:
        """Launched student server i listens on port + i, a launched teacher j on the port after the students' + j:
        all <= 65535."""
        students = self.kind == "vllm" and not self.urls("student_urls")
        teacher = self.kind == "vllm" and self.teacher_engine == "vllm" and not self.urls("teacher_url")
        last = self.port + (self.student_servers if students else 0) + (self.teacher_servers if teacher else 0) - 1
        if (students or teacher) and last > 65535:
            fail(self._key("port"), f"the servers selfopd launches take ports {self.port} to {last} (engine.port + "
                 f"engine.student_servers + engine.teacher_servers), past 65535; choose engine.port <= "
                 f"{self.port - (last - 65535)}")

    def _check_server_args(self) -> None:
        """extra_server_args must split as a shell would, here rather than when the servers start."""
        check_printable(self._key("extra_server_args"), self.extra_server_args)
        try:
            words = shlex.split(self.extra_server_args)
        except ValueError as error:  # "No closing quotation", "No escaped character"
            fail(self._key("extra_server_args"), f"does not parse as shell words ({error}): "
                 f"{self.extra_server_args!r}; quote or escape it as a shell would")
        if (problem := server_args_problem(words)) is not None:
            fail(self._key("extra_server_args"), problem)

    def _check_distinct_servers(self) -> None:
        """A student server listed twice would take twice the prompts and be sent the weights once."""
        seen: dict[str, str] = {}
        for url in self.urls("student_urls"):
            key = server_key(url)
            if key in seen:
                fail(self._key("student_urls"), f"lists one server twice ({seen[key]} and {url}): list it once")
            seen[key] = url

    def api_key(self) -> str | None:
        """The servers' API key, read from the variable `api_key_env` names (None without one)."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key:
            fail(self._key("api_key_env"), f"names the environment variable {self.api_key_env}, which is not set "
                 "or empty here; export the servers' API key in it")
        return key

    def launch_key(self) -> str | None:
        """The key of the servers selfopd launches (None: each launch makes its own): engine.api_key_env's,
        refused unless it looks like a secret, since it alone keeps the network off those servers' routes."""
        key = self.api_key()
        if key is not None and (len(key) < MIN_KEY_CHARACTERS or len(set(key)) < 10 or not key.isascii()
                                or not key.isprintable() or any(char.isspace() for char in key)):
            fail(self._key("api_key_env"), f"the value of {self.api_key_env} is not a key a launched server can "
                 f"take: it must be {MIN_KEY_CHARACTERS} or more random printable characters without spaces (e.g. "
                 f"export {self.api_key_env}=$(openssl rand -hex 32)); the value is not shown")
        return key

    def teacher_parallel_size(self) -> int:
        """The launched teacher server's tensor-parallel size (it may differ from the students')."""
        return self.teacher_tensor_parallel_size or self.tensor_parallel_size

    def gpus(self, name: str) -> list[int]:
        """The GPU indices in `student_gpus` or `teacher_gpus`."""
        return [int(gpu) for gpu in getattr(self, name).split(",") if gpu.strip()]

    @property
    def teacher_in_process(self) -> bool:
        """The teacher scores in the trainer's process: engine.kind = 'local', or vLLM sampling with
        engine.teacher_engine = 'local'."""
        return self.kind == "local" or (self.kind == "vllm" and self.teacher_engine == "local")

    def urls(self, name: str) -> list[str]:
        """The URLs in `student_urls` or `teacher_url`, without trailing slashes."""
        return [url.strip().rstrip("/") for url in getattr(self, name).split(",") if url.strip()]


MIN_KEY_CHARACTERS = 32  # 128 bits as hex; a variable such as HOME or USER holds no secret


def is_loopback(host: str) -> bool:
    """`host` is this machine only (localhost, 127.0.0.0/8, ::1): nothing else can connect to it."""
    import ipaddress

    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False


def server_key(url: str) -> str:
    """host:port of a server URL, with localhost and the default port spelled one way."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    host = "127.0.0.1" if host in ("localhost", "::1") else host
    return f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
