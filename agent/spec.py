"""Model config + state dict → ModelSpec, or one clear line saying what is wrong.

Everything downstream (templates, evaluator) trusts the inputs; this is where a wrong
shape, a missing tensor or an unsupported feature is caught, named, and stops the run
before anything is written to the workspace.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from evaluator.checkpoint import (COURSE_EPS, SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, CheckpointError, Conventions,
                                 conventions, not_a_folder, rope_parameters, shown, stored_dtype_name, with_config_defaults)

WEIGHTS_FILE = "model.pt"
REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
DEFAULT_THETA = 10000.0
DEFAULT_MAX_POSITIONS = 4096
# Config keys that change the math the reference implements: present and not null/false → refuse.
UNSUPPORTED_IF_SET = {
    "rope_scaling": "RoPE scaling",
    "sliding_window": "sliding-window attention",
    "attention_bias": "attention biases",
    "mlp_bias": "MLP biases",
}
SUPPORTED_ACTIVATIONS = ("silu", "swish")
HF_WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN)   # a folder holding one is an HF folder
# Optional config keys that shape these tensors: a shape mismatch names the one the config left out
# (a missing num_key_value_heads read as num_attention_heads, and the k_proj error never said so).
DEFAULTED_SHAPES = {"num_key_value_heads": ("k_proj", "v_proj"),
                    "head_dim": ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
# torch_dtype names read without a warning (the stored dtype's, lower case): bf16's select bf16, the rest fp16
KNOWN_DTYPES = ("float16", "fp16", "half", "bfloat16", "bf16")
# Bounds on integer sizes: far above any real model (hidden 16384, mlp 53248 for the largest
# LLaMA), low enough that an absurd value (10**100 from a typo or an attack) is refused here,
# by name, rather than deep inside torch.
MAX_SIZE = 2**20
SIZE_LIMITS = {"vocab_size": 2**24, "max_position_embeddings": 2**24}


class SpecError(Exception):
    """A problem with the inputs, phrased for the user in one line."""


@dataclass(frozen=True)
class ModelSpec:
    config_path: Path
    weight_dir: Path
    config: dict
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    eps: float
    theta: float
    dtype: str                              # "float16" | "bfloat16": the CUDA compute dtype
    conventions: Conventions = Conventions()  # the course format's, or an HF folder's
    parameters: int = 0
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        gqa = "MHA" if self.kv_heads == self.heads else ("MQA" if self.kv_heads == 1 else "GQA")
        text = (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads × {self.head_dim} "
                f"({gqa}, {self.kv_heads} kv), mlp {self.intermediate}, vocab {self.vocab}, "
                f"{self.dtype}, {self.parameters / 1e6:.1f}M params")
        if self.conventions.hf:
            text += f"; {self.config['architectures'][0]}: {self.conventions.describe()}"
        return text

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """The SPEC §1 weight layout for this config (the evaluator's table: one layout, one place)."""
        from evaluator.common import ModelDims
        from evaluator.weights import weight_shapes

        return weight_shapes(ModelDims(self.hidden, self.intermediate, self.layers, self.heads, self.kv_heads,
                                       self.head_dim, self.vocab, self.eps, self.theta, self.dtype),
                             self.conventions)

    def to_dict(self) -> dict:
        keys = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab",
                "max_positions", "eps", "theta", "dtype", "parameters")
        out = {"config_path": str(self.config_path), "weight_dir": str(self.weight_dir),
               **{k: getattr(self, k) for k in keys}, "warnings": list(self.warnings)}
        if self.conventions.hf:
            out["conventions"] = self.conventions.describe()
        return out


def read_config(path: Path) -> dict:
    """The config file as a dict, through the evaluator's careful loader (both sides read a
    config by the same rules): any unusable file is one SpecError line."""
    from evaluator.common import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise SpecError(str(e)) from None


def _positive_int(config: dict, key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if value is None:
        raise SpecError(f"model config is missing required key '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"model config key '{key}' must be a positive integer, got {shown(value)}")
    limit = SIZE_LIMITS.get(key, MAX_SIZE)
    if value > limit:
        raise SpecError(f"model config key '{key}' is {shown(value)}, above {limit}: not a size this agent takes")
    return value


def _positive_float(config: dict, key: str, default: float) -> float:
    """The key's value, its default where the config leaves it out. A null is not left out: the
    reference, the engines and transformers 5 all fail on one (float(None)), and it had passed here
    as the default, so the run ended with no engine instead of this line (unseen-configs sweep, thirty-ninth session)."""
    if key not in config:
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(
            _as_float(value)):
        raise SpecError(f"model config key '{key}' must be a positive number, got {shown(value)}")
    return float(value)


def _as_float(value: int | float) -> float:
    """float(value), inf for an integer past float's range (float() raises there)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def spec_from_config(config: dict, config_path: Path, weight_dir: Path) -> ModelSpec:
    """Sizes and numerics from the config, with SPEC's defaults, refusing what the reference cannot
    run: for the course format any key of UNSUPPORTED_IF_SET, for an HF config whatever its
    conventions cannot express (evaluator/checkpoint.py)."""
    config = with_config_defaults(config)   # load_config's already; a caller's own dict too
    try:
        conv = conventions(config)
    except CheckpointError as e:
        raise SpecError(str(e)) from None
    for key, feature in UNSUPPORTED_IF_SET.items() if not conv.hf else ():
        if config.get(key) not in (None, False):
            raise SpecError(f"unsupported feature: {feature} (model config key '{key}' = {shown(config[key])})")
    act = config.get("hidden_act")
    if act is not None and act not in SUPPORTED_ACTIVATIONS:
        raise SpecError(f"unsupported feature: activation {shown(act)} (model config key 'hidden_act'; only SwiGLU/silu)")
    sizes = {k: _positive_int(config, k) for k in REQUIRED_INTS}
    heads = sizes["num_attention_heads"]
    given = config.get("head_dim")   # null reads as absent, as in transformers
    if given is None and sizes["hidden_size"] % heads:
        raise SpecError(f"model config has no 'head_dim' and hidden_size {sizes['hidden_size']} "
                        f"is not divisible by num_attention_heads {heads}")
    head_dim = sizes["hidden_size"] // heads if given is None else _positive_int(config, "head_dim")
    kv_heads = _positive_int(config, "num_key_value_heads", heads)
    if heads % kv_heads:
        raise SpecError(f"unsupported feature: num_attention_heads {heads} is not a multiple of "
                        f"num_key_value_heads {kv_heads} (model config key 'num_key_value_heads')"
                        f"{_defaulted(config, _left_out(config_path, ['num_key_value_heads']))}")
    if head_dim % 2:
        raise SpecError(f"unsupported feature: odd head_dim {head_dim} (interleaved RoPE rotates pairs; "
                        f"model config key 'head_dim')")
    dtype = stored_dtype_name(config).lower()
    warnings = [] if conv.hf or "rope_parameters" not in config else [
        "model config key 'rope_parameters' is not part of the course format: ignored, as the course's "
        "reference ignores it (RoPE reads 'rope_theta')"]
    if not conv.hf and config.get("torch_dtype") is not None and dtype not in KNOWN_DTYPES:   # SPEC.md: anything but bf16 is fp16; a typo should not pass unseen
        warnings.append(f"model config torch_dtype {shown(config.get('torch_dtype', dtype))} is neither float16 nor "
                        "bfloat16: the engine computes in float16 on a GPU, as the course's reference does")
    return ModelSpec(
        config_path=config_path, weight_dir=weight_dir, config=config,
        hidden=sizes["hidden_size"], intermediate=sizes["intermediate_size"], layers=sizes["num_hidden_layers"],
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=sizes["vocab_size"],
        max_positions=_positive_int(config, "max_position_embeddings", DEFAULT_MAX_POSITIONS),
        eps=_positive_float(config, "rms_norm_eps", COURSE_EPS),
        theta=_positive_float(rope_parameters(config) if conv.hf and "rope_theta" not in config else config,
                              "rope_theta", DEFAULT_THETA),
        dtype="bfloat16" if dtype in ("bfloat16", "bf16") else "float16",
        conventions=conv,
        warnings=tuple(warnings),
    )


def check_window_covers(spec: ModelSpec, cases: list[str]) -> None:
    """A model whose sliding window is shorter than a context the judge checks or times (the
    benchmark `cases`, the full stress suite's long prompt: the self-test README gives for the
    engine written, and an official check's) is refused here: the engines attend to every
    position and refuse contexts past the window, so the engine written could not pass them.
    (The search's own quick stress asks less of the target: this is the stricter bound.)"""
    from evaluator.checkpoint import attention_window
    from evaluator.traces import longest_checked_context

    window = attention_window(spec.config) if spec.conventions.hf else None
    longest = longest_checked_context(cases)
    if window is not None and window < longest:
        raise SpecError(f"unsupported feature: sliding window {window} is shorter than the {longest}-token "
                        "contexts the judge checks (model config key 'sliding_window'; the engines attend to "
                        "every position and refuse a context past the window)")


def load_state_dict(weight_dir: Path, config_path: Path | None = None) -> dict:
    from evaluator.common import load_course_file   # torch with it: only where weights are read

    if not weight_dir.is_dir():
        raise SpecError(not_a_folder(weight_dir))
    path = weight_dir / WEIGHTS_FILE
    if not path.is_file():
        held = [name for name in HF_WEIGHT_FILES if (weight_dir / name).is_file()]
        why = (f" ({weight_dir} holds {held[0]}: a Hugging Face folder's config.json names its class in "
               "'architectures', e.g. [\"LlamaForCausalLM\"], and this one has no such key)") if held else ""
        if held and config_path is not None and not (weight_dir / "config.json").is_file():
            # the run fell back to the course's config: the folder's own config.json is what is missing
            why = (f" ({weight_dir} holds {held[0]} but no config.json, so the model config read was {config_path}, "
                   "a course config: give the folder's config.json)")
        raise SpecError(f"missing weights file: {path}{why}")
    try:
        state = load_course_file(path)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is the same user-facing problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SpecError(f"cannot load {path} as a state dict: {first}") from None
    if not isinstance(state, dict):
        raise SpecError(f"{path} is not a state dict (a dict of tensors), got {type(state).__name__}")
    return state


def check_weights(spec: ModelSpec, state: dict) -> ModelSpec:
    """Every expected tensor present, floating, of the right shape and finite; biases refused."""
    import torch

    path = spec.weight_dir / WEIGHTS_FILE
    bad_names = [k for k in state if not isinstance(k, str)]
    if bad_names:
        raise SpecError(f"{path}: key {bad_names[0]!r} is not a string")
    biases = sorted(k for k in state if k.endswith(".bias"))
    if biases:
        raise SpecError(f"unsupported feature: biases ('{biases[0]}' in {path})")
    expected = spec.expected_shapes()
    if "embed_tokens.weight" not in state and "model.embed_tokens.weight" in state:
        raise SpecError(f"unsupported key layout: '{path}' keys carry a 'model.' prefix "
                        f"(e.g. 'model.embed_tokens.weight'); expected 'embed_tokens.weight'")
    if "lm_head.weight" not in state and spec.config.get("tie_word_embeddings"):
        raise SpecError("unsupported feature: tied embeddings (tie_word_embeddings is true and "
                        f"'lm_head.weight' is missing from {path})")
    params = 0
    for key, shape in expected.items():
        if key not in state:
            raise SpecError(f"missing tensor '{key}' in {path}")
        t = state[key]
        if not isinstance(t, torch.Tensor):
            raise SpecError(f"'{key}' in {path} is not a tensor (got {type(t).__name__})")
        if not t.is_floating_point():
            raise SpecError(f"'{key}' in {path} has dtype {t.dtype}, expected a floating-point tensor")
        if tuple(t.shape) != shape:
            raise SpecError(f"'{key}' has shape {list(t.shape)}, expected {list(shape)} from the model config"
                            f"{defaulted_hint(spec, key)}")
        if not bool(torch.isfinite(t).all()):
            raise SpecError(f"'{key}' in {path} has non-finite values (nan or inf)")
        params += t.numel()
    extra = sorted(k for k in state if k not in expected)
    warnings = list(spec.warnings)
    if extra:
        layer = re.compile(r"layers\.(\d+)\.")
        beyond = [k for k in extra if (m := layer.match(k)) and int(m.group(1)) >= spec.layers]
        why = f" (layers beyond num_hidden_layers={spec.layers}?)" if beyond else ""
        warnings.append(f"{len(extra)} unexpected tensor(s) ignored{why}, e.g. '{extra[0]}'")
    return replace(spec, parameters=params, warnings=tuple(warnings))


def _left_out(config_path: Path, keys) -> list[str]:
    """Which of `keys` the config file as written leaves out (or sets null): read as defaults."""
    try:
        written = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return []
    return [k for k in keys if not isinstance(written, dict) or written.get(k) is None]


def _defaulted(config: dict, keys: list[str]) -> str:
    """' (absent from the config, so read as its default: ...)' for those keys, or ""."""
    if not keys:
        return ""
    return " (absent from the config, so read as its default: " + ", ".join(
        f"{k} {config[k]}" if config.get(k) is not None else k for k in keys) + ")"


def defaulted_hint(spec: ModelSpec, tensor: str) -> str:
    """For a tensor whose shape the config did not predict: the keys shaping it that the config file
    leaves out (read as a default: the course's derivation, or an HF architecture's own), or ""."""
    shaping = [k for k, shaped in DEFAULTED_SHAPES.items() if any(part in tensor for part in shaped)]
    return _defaulted(spec.config, _left_out(spec.config_path, shaping))


def load_spec(config_path: str | Path, weight_dir: str | Path) -> ModelSpec:
    """The whole check; raises SpecError with a one-line message on the first problem."""
    config_path, weight_dir = Path(config_path), Path(weight_dir)
    spec = spec_from_config(read_config(config_path), config_path, weight_dir)
    if spec.conventions.hf:
        from agent.checkpoint import check_hf_weights

        return check_hf_weights(spec, SpecError)
    return check_weights(spec, load_state_dict(weight_dir, config_path))
