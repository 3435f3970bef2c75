"""A model folder's config.json is checked against the weights beside it before anything is built.

transformers builds a model from its config before it reads a single weight, so a config from
elsewhere (a hub repository, a colleague's folder, a damaged copy) that says `num_hidden_layers =
10**9`, or sizes far past what its safetensors files hold, grows memory for minutes before any
error; `vocab_size = -1` ends in a traceback from inside torch. Two checks, on the config's dict:

- `size_problem`: each size a config gives (layers, widths, heads, vocabulary, positions: SIZE_KEYS,
  in the config and every config nested in it, `text_config` and `vision_config` included) is a
  whole number of at most MAX_SIZE, positive for those every model has (CORE_KEYS);
- `weights_problem`: the parameters the config describes are at most WEIGHTS_FACTOR times (plus
  WEIGHTS_SLACK) the elements its safetensors headers declare. `parameter_estimate` is a lower
  bound of what the config builds: the embedding once (tied or not), and per layer the attention's
  query and output projections and the MLP's up and down projections (one expert's, for a
  mixture of experts), for the language model and each tower nested beside it. The key and value
  projections, the MLP's gate, norms, biases and every other expert are left out, so the measured
  ratio of the estimate to the weights is below 1 for every family the tests build (see
  tests/core/test_model_sizes.py) and the factor only absorbs what the lower bound cannot see.
  A quantized model (a `quantization_config`) packs several parameters in an element: its
  weights count as one parameter a bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MAX_SIZE = 2**24  # past any model's width, depth, vocabulary (262k) or context (10M tokens)
WEIGHTS_FACTOR = 2
WEIGHTS_SLACK = 2**20  # elements: a tiny test model's norms and biases are a large share of it
# Sizes a config gives, under the names of the families transformers knows (the first of each
# tuple is the name most configs use); a size may be a list or table of them (per stage, per layer).
HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "depth")
HEADS = ("num_attention_heads", "n_head", "num_heads")
INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts")
SIZE_KEYS = (*HIDDEN, *LAYERS, *HEADS, *INTERMEDIATE, "vocab_size", "head_dim", "num_key_value_heads",
             "moe_intermediate_size", "max_position_embeddings", "n_positions")
CORE_KEYS = frozenset((*HIDDEN, *LAYERS, *HEADS, "vocab_size"))  # every model has them, none of them 0
WHOLE = {0: "a whole number >= 0", 1: "a positive whole number"}
NESTING = 3  # how deep configs nest (a vision-language config's text_config, ...)


def size_problem(config: dict[str, Any], where: str) -> str | None:
    """The first size of `config` (read from the file `where`) that is not a whole number of at most
    MAX_SIZE, positive for the sizes every model has (CORE_KEYS), as '{where}: {key} = {value}: ...'
    (None: every one is)."""
    for key, given in _sizes(config):
        for value in given if isinstance(given, list) else given.values() if isinstance(given, dict) else [given]:
            least = 1 if key.rsplit(".", 1)[-1] in CORE_KEYS else 0
            whole = (isinstance(value, float) and value.is_integer()
                     or isinstance(value, int) and not isinstance(value, bool))
            if not whole or value < least:
                return f"{where}: {key} = {_shown(given)}: a model size must be {WHOLE[least]}"
            if value > MAX_SIZE:
                return f"{where}: {key} = {_shown(given)}: past {MAX_SIZE:,}, the most a model size can be"
    return None


def _shown(value: Any) -> str:
    """`value` as the config gives it, cut to 60 characters (a config can hold a million of them)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def _sizes(config: dict[str, Any], prefix: str = "", depth: int = 0) -> list[tuple[str, Any]]:
    """(dotted key, value) of every size `config` and the configs nested in it give (None: not given)."""
    found = [(prefix + key, config[key]) for key in SIZE_KEYS if config.get(key) is not None]
    if depth < NESTING:
        for key, value in config.items():
            if isinstance(value, dict):
                found += _sizes(value, f"{prefix}{key}.", depth + 1)
    return found


def weights_problem(config: dict[str, Any], where: str, elements: int, data_bytes: int) -> str | None:
    """Why `config` (read from `where`) describes more than its weights hold: more than
    WEIGHTS_FACTOR x (plus WEIGHTS_SLACK) the `elements` of its safetensors files (None: it does not).
    `data_bytes`: those files' size, what a quantized model's weights count as (a parameter a bit)."""
    quantized = any(isinstance(part, dict) and "quantization_config" in part
                    for part in (config, config.get("text_config")))
    held = max(elements, 8 * data_bytes) if quantized else elements
    estimate, sizes = parameter_estimate(config)
    if estimate <= WEIGHTS_FACTOR * held + WEIGHTS_SLACK:
        return None
    return (f"{where}: its sizes ({sizes}) describe a model of at least {estimate:,} parameters, more than "
            f"{WEIGHTS_FACTOR}x the {held:,} its safetensors files hold (a damaged or hostile config): refused "
            "before anything is built")


def parameter_estimate(config: dict[str, Any]) -> tuple[int, str]:
    """A lower bound of the parameters `config` builds (module docstring), and the sizes of the
    part that contributes most ('num_hidden_layers 2, hidden_size 64, ...') to name in an error."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
    parts = [("text_config." if text is not None else "", {**config, **text} if text is not None else config, True)]
    parts += [(f"{key}.", value, False) for key, value in config.items()
              if isinstance(value, dict) and key != "text_config" and _first(value, LAYERS)[1]]
    estimates = [(_tower(part, embedded), prefix, part) for prefix, part, embedded in parts]
    total = sum(estimate for estimate, _, _ in estimates)
    _, prefix, part = max(estimates, key=lambda item: item[0])
    named = [_first(part, names) for names in (LAYERS, HIDDEN, INTERMEDIATE)] + [("vocab_size", part.get("vocab_size"))]
    return total, ", ".join(f"{prefix}{key} {value}" for key, value in named if isinstance(value, int))


def _tower(config: dict[str, Any], embedded: bool) -> int:
    """A lower bound of one stack of layers' parameters (its embedding when `embedded`)."""
    hidden, layers = _number(config, HIDDEN), _number(config, LAYERS)
    heads = _number(config, HEADS)
    head_dim = config.get("head_dim") if _positive(config.get("head_dim")) else (hidden // heads if heads else 0)
    attention = 2 * hidden * (heads * head_dim if heads else hidden)
    intermediate = _number(config, INTERMEDIATE)
    experts, expert_size = _number(config, EXPERTS), _number(config, ("moe_intermediate_size",))
    if experts and expert_size:
        intermediate = min(intermediate, experts * expert_size) if intermediate else expert_size
    vocabulary = _number(config, ("vocab_size",)) if embedded else 0
    return vocabulary * hidden + layers * (attention + 2 * hidden * intermediate)


def _first(config: dict[str, Any], names: tuple[str, ...]) -> tuple[str, Any]:
    return next(((name, config[name]) for name in names if config.get(name) is not None), (names[0], None))


def _number(config: dict[str, Any], names: tuple[str, ...]) -> int:
    """The first of `names` that `config` gives, when it is one whole number (else 0: not counted)."""
    value = _first(config, names)[1]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if _positive(value) else 0


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def config_problem(config_path: Path, config: dict[str, Any], elements: int | None, data_bytes: int) -> str | None:
    """`size_problem`, then (when the folder holds safetensors files: `elements` not None)
    `weights_problem` of the config.json `config_path` holding `config`."""
    problem = size_problem(config, str(config_path))
    if problem is None and elements is not None:
        problem = weights_problem(config, str(config_path), elements, data_bytes)
    return problem

