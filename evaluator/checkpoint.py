"""Hugging Face model folders: the conventions a config names, and its weights under the
course's bare names.

Two formats, told apart by the config alone (the reference is given a config and a state dict,
never a folder): the course format (SPEC.md §1: no `architectures` key, one `model.pt` of bare
names, interleaved RoPE, untied head) and a Hugging Face folder (`architectures` names a
Llama-family class; `model.safetensors`, sharded safetensors + `model.safetensors.index.json`,
or `pytorch_model.bin`; `model.`-prefixed names; rotate-half RoPE). Everything downstream sees
one state dict of bare names (`embed_tokens.weight`, `layers.N.…`, `norm.weight`,
`lm_head.weight`, plus `…q_proj.bias` and `…q_norm.weight` where the model has them) and a
`Conventions` saying how to run it. The course format's conventions are all defaults, so the
course path reads and computes exactly as before.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
HF_PREFIX = "model."
# Architecture → (q/k/v biases, per-head q/k RMSNorm). Anything else is refused by name.
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
# ... and the model_type transformers' AutoConfig builds each from (it reads model_type, not architectures).
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
ROPE_TYPES = ("default", "llama3")
DEFAULT_WINDOW = 4096                   # Mistral's and Qwen's configs' sliding_window when a config has no such key
QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")   # a window only with use_sliding_window
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28     # their configs' default: layers from this one on slide
# Layer kinds of `layer_types` the engines run: a sliding layer slides only where attention_window
# says transformers makes it (a Qwen config with use_sliding_window false attends fully there).
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' config classes' own defaults where they differ from what this code derives for a key a
# config leaves out (rms_norm_eps 1e-5 as SPEC.md says, num_key_value_heads = num_attention_heads,
# head_dim = hidden_size / num_attention_heads): an HF config.json without the key means these, in
# transformers 4.x and 5.x alike. A null value is not "left out" (transformers then derives the generic one).
CONFIG_DEFAULTS = {
    "LlamaForCausalLM": {"rms_norm_eps": 1e-6},
    "MistralForCausalLM": {"rms_norm_eps": 1e-6, "num_key_value_heads": 8},
    "Qwen2ForCausalLM": {"rms_norm_eps": 1e-6, "num_key_value_heads": 32},
    "Qwen3ForCausalLM": {"rms_norm_eps": 1e-6, "num_key_value_heads": 32, "head_dim": 128},
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Flags and counts an HF config may leave out but not set null: transformers 5's config classes refuse
# a null there, 4.x reads it as false or fails, and this code had read each its own way (a null
# max_window_layers beside use_sliding_window passed the agent and made every engine raise in
# create_engine; unseen-configs sweep, thirty-ninth session).
NOT_NULL = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window", "max_window_layers")
# ... and per architecture: a null head_dim is hidden / heads to Llama's and Mistral's configs, but
# Qwen3's refuses it and Qwen2's attention takes None for the size (transformers fails either way).
NOT_NULL_FOR = {"Qwen2ForCausalLM": ("head_dim",), "Qwen3ForCausalLM": ("head_dim",)}
# Config keys that mean experts (mixture of experts): the reference runs dense MLPs only.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
DEFAULT_THETA = 10000.0
COURSE_EPS = 1e-5        # SPEC.md's rms_norm_eps where a course config has none


def shown(value: object) -> str:
    """A config value as an error message may quote it: short, whatever its size (a 400-digit
    integer had made a refusal a 400-character line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


class CheckpointError(ValueError):
    """A model folder or config this code cannot run, said in one line naming the key or file."""


@dataclass(frozen=True)
class Llama3Scaling:
    """rope_scaling of type `llama3`: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend between (Llama 3.1/3.2)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass(frozen=True)
class Conventions:
    """How a model computes, beyond its sizes. The defaults are the course format's."""

    hf: bool = False                        # HF folder: model.-prefixed names, rotate-half RoPE
    rope_scaling: Llama3Scaling | None = None
    qkv_bias: bool = False                  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False                   # per-head RMSNorm of q and k before RoPE (Qwen3)
    tied: bool = False                      # lm_head is embed_tokens
    config_defaults: tuple[tuple[str, float | int], ...] = ()   # CONFIG_DEFAULTS of its architecture

    @property
    def architectures(self) -> dict[str, tuple[bool, bool]]:
        """ARCHITECTURES, for an engine to tell a config of other conventions (rendered in)."""
        return dict(ARCHITECTURES)

    @property
    def rope_style(self) -> str:
        return "rotate_half" if self.hf else "interleaved"

    def describe(self) -> str:
        parts = [f"{self.rope_style} RoPE"]
        if self.rope_scaling:
            parts.append(f"llama3 rope scaling x{self.rope_scaling.factor:g}")
        parts += [name for name, on in (("q/k/v biases", self.qkv_bias), ("q/k norm", self.qk_norm),
                                        ("tied embeddings", self.tied)) if on]
        return ", ".join(parts)


def not_a_folder(weight_dir: Path | str) -> str:
    """The one line for a weights path that is no folder: a file given for it (a config, a model.pt)
    is said as such, not as missing."""
    if Path(weight_dir).exists():
        return f"weights must be a folder, and {weight_dir} is a file (give the folder that holds it)"
    return f"weights directory not found: {weight_dir}"


def is_hf(config: dict) -> bool:
    return "architectures" in config


def config_defaults(config: dict) -> dict:
    """The values an HF config's architecture gives the keys CONFIG_DEFAULTS names ({} for the course
    format, or an architecture this code does not run)."""
    archs = config.get("architectures")
    if is_hf(config) and isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str):
        return dict(CONFIG_DEFAULTS.get(archs[0], {}))
    return {}


def with_config_defaults(config: dict) -> dict:
    """The config with its architecture's defaults written in for the keys it leaves out: read so
    by the spec, the reference, the judge and the engines (a Qwen2 config without
    num_key_value_heads is 32 KV heads in transformers, not one a query head; a Llama config without
    rms_norm_eps is 1e-6, and the engines had computed with the course's 1e-5). A null
    num_key_value_heads is what transformers makes of it: one KV head a query head."""
    out = {**config_defaults(config), **config}
    if is_hf(config) and "num_key_value_heads" in config and config["num_key_value_heads"] is None:
        out["num_key_value_heads"] = config.get("num_attention_heads")
    return out


def rope_parameters(config: dict) -> dict:
    """RoPE settings as one dict: transformers 5 writes `rope_parameters` (theta inside), older
    checkpoints `rope_theta` and `rope_scaling` side by side. A config holding both forms must
    say the same in both (_check_rope_forms): which one transformers reads has changed between
    its versions (5.x lets a legacy `rope_scaling` win)."""
    params = config.get("rope_parameters")
    if params is None:
        params = dict(config.get("rope_scaling") or {})
        if "rope_theta" in config:
            params["rope_theta"] = config["rope_theta"]
    if not isinstance(params, dict):
        raise CheckpointError(f"model config key 'rope_parameters' must be an object, got {params!r}"[:200])
    return params


def _rope_kind(params: dict) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rope_forms(config: dict) -> None:
    """Refuse, naming both keys, a config whose two RoPE forms disagree: a `rope_theta` beside
    `rope_parameters` with another base, or a `rope_scaling` beside it of another type, factors or
    base. (Run either way, one of transformers' versions would compute another model: a sweep of
    unseen configs found both read silently, twenty-ninth session.) Transformers 5 reads a legacy
    `rope_scaling` over `rope_parameters`, and a base inside it over `rope_theta`; 4.x reads
    `rope_theta` (else 10000) and never a base inside either dict: a `rope_parameters` base
    beside a `rope_scaling`, or a `rope_scaling` base, is refused where the two would differ
    (the judge and the engines had each read one of them, 0.8 off at the logits)."""
    top, legacy = config.get("rope_theta"), config.get("rope_scaling")
    if legacy and not isinstance(legacy, dict):   # a list or a string had ended the agent with a traceback
        raise CheckpointError(f"model config key 'rope_scaling' must be an object, got {legacy!r}"[:200])
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and any(isinstance(v, dict) for v in nested.values()):
        raise CheckpointError("unsupported feature: RoPE settings per layer type (model config key 'rope_parameters' "
                              f"holds objects: {', '.join(k for k, v in nested.items() if isinstance(v, dict))})"[:300])
    # 4.x's base, whatever the dicts hold; compared as the numbers they are (an integer past float's
    # range has no float(): it had ended the agent with a traceback instead of this one line)
    base = top if _number(top) else DEFAULT_THETA
    shown = f"'rope_theta' ({top!r})" if _number(top) else f"'rope_theta' (absent: {DEFAULT_THETA})"
    if isinstance(legacy, dict) and _number(legacy.get("rope_theta")) and legacy["rope_theta"] != base:
        raise CheckpointError(f"model config keys 'rope_scaling.rope_theta' ({legacy['rope_theta']!r}) and {shown} "
                              "disagree")
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return
    inner = params.get("rope_theta")
    if _number(inner) and inner != base and (_number(top) or isinstance(legacy, dict) and legacy):
        raise CheckpointError(f"model config keys {shown} and 'rope_parameters.rope_theta' ({inner!r}) disagree"
                              + ("" if _number(top) else " (a 'rope_scaling' beside them: transformers reads it, "
                                                         "and the base outside 'rope_parameters')"))
    if isinstance(legacy, dict) and legacy:
        kind = _rope_kind(legacy)
        differ = kind != _rope_kind(params) or any(legacy.get(k) != params.get(k) for k in LLAMA3_KEYS if kind == "llama3")
        if differ:
            raise CheckpointError(f"model config keys 'rope_scaling' ({kind}) and 'rope_parameters' "
                                  f"({_rope_kind(params)}) disagree")


def rope_theta(config: dict) -> float:
    """The RoPE base: `rope_theta` (the course; older checkpoints), else, for an HF config,
    the one inside `rope_parameters` (transformers 5)."""
    if "rope_theta" in config or not is_hf(config):
        return float(config.get("rope_theta", DEFAULT_THETA))
    return float((config.get("rope_parameters") or {}).get("rope_theta", DEFAULT_THETA))


def stored_dtype_name(config: dict) -> str:
    """`torch_dtype` (the course; older checkpoints), else, for an HF config, `dtype`
    (transformers 5); float16 when neither is given."""
    if "torch_dtype" in config or not is_hf(config):
        return str(config.get("torch_dtype", "float16"))
    return str(config.get("dtype", "float16"))


def _rope_scaling(config: dict) -> Llama3Scaling | None:
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    params = rope_parameters(config)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"unsupported feature: RoPE type {shown(kind)} (model config key '{key}'; "
                              f"supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    missing = [k for k in LLAMA3_KEYS if not isinstance(params.get(k), (int, float)) or not params[k] > 0]
    if missing:
        raise CheckpointError(f"model config key '{key}' of type llama3 needs a positive '{missing[0]}'")
    if not params["high_freq_factor"] > params["low_freq_factor"]:
        raise CheckpointError(f"model config key '{key}': high_freq_factor must exceed low_freq_factor")
    top = config.get("original_max_position_embeddings")
    if top is not None and top != params["original_max_position_embeddings"]:   # 5.x reads it, 4.x the key's own
        raise CheckpointError(f"model config keys 'original_max_position_embeddings' ({shown(top)}) and "
                              f"'{key}.original_max_position_embeddings' ({shown(params['original_max_position_embeddings'])}) "
                              "disagree")
    return Llama3Scaling(float(params["factor"]), float(params["low_freq_factor"]),
                         float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))


def conventions(config: dict) -> Conventions:
    """The config's conventions, or CheckpointError naming the key of what cannot be run."""
    if not is_hf(config):
        return Conventions()
    archs = config["architectures"]
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        raise CheckpointError(f"unsupported architecture {archs!r} (model config key 'architectures'; "
                              f"supported: {', '.join(ARCHITECTURES)})"[:300])
    model_type = config.get("model_type")
    if model_type is not None and model_type != MODEL_TYPES[archs[0]]:
        raise CheckpointError(f"model config key 'model_type' is {shown(model_type)}, not {MODEL_TYPES[archs[0]]!r} "
                              f"as 'architectures' ({archs[0]}) says: transformers builds the model model_type "
                              "names")
    for key in NOT_NULL + NOT_NULL_FOR.get(archs[0], ()):
        if key in config and config[key] is None:
            raise CheckpointError(f"model config key '{key}' is null: transformers reads no model from it (give "
                                  "its value, or leave the key out for its default)")
    _check_rope_forms(config)
    qkv_bias, qk_norm = ARCHITECTURES[archs[0]]
    for key in MOE_KEYS:
        if config.get(key):
            raise CheckpointError(f"unsupported feature: mixture of experts (model config key '{key}')")
    if config.get("mlp_bias"):
        raise CheckpointError("unsupported feature: MLP biases (model config key 'mlp_bias')")
    if config.get("attention_bias") and not qkv_bias:
        raise CheckpointError(f"unsupported feature: attention biases for {archs[0]} (model config key "
                              f"'attention_bias')")
    if config.get("hidden_act", "silu") not in ("silu", "swish"):
        raise CheckpointError(f"unsupported feature: activation {shown(config['hidden_act'])} (model config key "
                              f"'hidden_act'; only SwiGLU/silu)")
    _check_full_rotary(config)
    _check_window(config)
    layer_types = config.get("layer_types") or []
    if not isinstance(layer_types, list):   # a number had ended the agent with a TypeError traceback
        raise CheckpointError(f"model config key 'layer_types' must be a list of layer kinds, got {layer_types!r}"[:200])
    if any(t not in LAYER_TYPES for t in layer_types):   # a sliding layer is attention_window's to rule on
        raise CheckpointError("unsupported feature: layers other than full or sliding attention (model config "
                              "key 'layer_types')")
    return Conventions(hf=True, rope_scaling=_rope_scaling(config), qkv_bias=qkv_bias, qk_norm=qk_norm,
                       tied=bool(config.get("tie_word_embeddings", False)),
                       config_defaults=tuple(sorted(config_defaults(config).items())))


def _check_full_rotary(config: dict) -> None:
    """Refuse partial rotary embeddings wherever a config says so: the top-level key (4.x reads it),
    or inside `rope_parameters` / `rope_scaling`, where transformers 5 moves it and its llama3 path
    reads it (its forward then fails). A null or a non-number is refused alike: a null had ended
    the agent with a TypeError traceback (unseen-configs sweep, thirty-ninth session)."""
    for key, holder in (("partial_rotary_factor", config), ("rope_parameters", config.get("rope_parameters")),
                        ("rope_scaling", config.get("rope_scaling"))):
        if not isinstance(holder, dict) or "partial_rotary_factor" not in holder:
            continue
        value = holder["partial_rotary_factor"]
        if not _number(value) or value != 1:
            name = key if holder is config else f"{key}.partial_rotary_factor"
            raise CheckpointError(f"unsupported feature: partial rotary embeddings (model config key '{name}' = "
                                  f"{value!r})"[:300])


def attention_window(config: dict) -> int | None:
    """The sliding window transformers applies to a Hugging Face config, or None (every layer
    attends to every position): Mistral's `sliding_window` (the config classes' 4096 where the key
    is absent, None where it is null); Qwen2's and Qwen3's only with `use_sliding_window` true (it
    defaults to false), and then only where some layer slides: as `layer_types` says, where given
    (transformers 5 writes it), else the layers from `max_window_layers` (default 28) on; never
    Llama's (LlamaConfig has no window). The engines carry the same rule (engine/hf/weights.py.j2)."""
    arch = config["architectures"][0]
    if arch == "MistralForCausalLM":
        return config.get("sliding_window", DEFAULT_WINDOW)
    if arch in QWEN_WINDOWED and config.get("use_sliding_window") is True:
        kinds = config.get("layer_types")
        if isinstance(kinds, list):        # transformers 5 writes each layer's kind: it decides
            sliding = any(k != "full_attention" for k in kinds)
        else:
            layers = config.get("num_hidden_layers")
            first = config.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
            sliding = not (isinstance(layers, int) and isinstance(first, int) and first >= layers)
        return config.get("sliding_window", DEFAULT_WINDOW) if sliding else None
    return None


def _check_window(config: dict) -> None:
    """Sliding-window attention is refused where it could bite: a window shorter than the
    context the engine is asked to serve (max_position_embeddings, which must then be given).
    The engines attend to every position and refuse a context past the window."""
    window = attention_window(config)
    if window is None:
        return
    limit = config.get("max_position_embeddings")
    if not isinstance(window, int) or not isinstance(limit, int) or limit > window:
        context = (f"max_position_embeddings {shown(limit)}" if isinstance(limit, int) else
                   "the context, which no max_position_embeddings bounds")
        raise CheckpointError(f"unsupported feature: sliding window {shown(window)} shorter than {context} "
                              f"(model config key 'sliding_window'; set max_position_embeddings to at most the "
                              f"window to run it)")


# Keys that carry a Hugging Face config's conventions (not its sizes): what a random stress
# model copies from the target so the engine written for the target runs it.
CONVENTION_KEYS = ("architectures", "tie_word_embeddings", "rope_scaling", "rope_parameters", "attention_bias")


def with_conventions_of(config: dict, target: dict) -> dict:
    """`config`'s sizes with `target`'s conventions; its own RoPE base (or the default) goes
    where the target keeps its base, so that one rule reads it (rope_theta). The keys whose default
    an architecture sets (CONFIG_DEFAULTS) are written out as `config` means them (its own value, or
    the course's derivation), so that taking the target's architecture does not change its shapes."""
    heads = config["num_attention_heads"]
    out = {"rms_norm_eps": COURSE_EPS, "num_key_value_heads": heads, **config,
           **{k: target[k] for k in CONVENTION_KEYS if k in target}}
    if out.get("head_dim") is None:
        out["head_dim"] = config["hidden_size"] // heads
    if "rope_parameters" in target:
        theta = out.pop("rope_theta", DEFAULT_THETA)
        out["rope_parameters"] = dict(target["rope_parameters"], rope_theta=theta)
        if target.get("rope_scaling"):   # transformers reads the rope_scaling beside it, and rope_theta
            out["rope_theta"] = theta
    if isinstance(out.get("rope_scaling"), dict) and "rope_theta" in out["rope_scaling"]:
        out["rope_scaling"] = dict(out["rope_scaling"], rope_theta=out.get("rope_theta", DEFAULT_THETA))
    out["model_type"] = target.get("model_type", out.get("model_type"))
    if is_hf(target) and "model_type" not in target:
        del out["model_type"]   # a course name beside an architecture would be refused (conventions)
    return out


# ---- files ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    name: str                   # the name in the file (HF, prefixed)
    shape: tuple[int, ...]
    dtype: str


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of the folder: the single file, else every shard the index names. The
    single file first, as transformers reads a folder holding both (4.x and 5.x alike): a folder
    with shards of one model beside another's model.safetensors had been read as the shards'."""
    if (folder / SAFETENSORS).is_file():
        return [folder / SAFETENSORS]
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index (a 'weight_map' object): "
                                  f"{type(e).__name__}") from None
        for name in names:
            if not isinstance(name, str) or "/" in name or not (folder / name).is_file():
                raise CheckpointError(f"{index} names a missing file: {name!r}")
        return [folder / name for name in names]
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    if shards:
        raise CheckpointError(f"{shards[0]} is a shard but {folder} has no {SAFETENSORS_INDEX}")
    return []


def list_tensors(folder: str | Path) -> dict[str, TensorInfo]:
    """Every tensor of an HF folder by its bare name, read lazily (headers only). Raises
    CheckpointError naming the file for a missing file or shard, a truncated or unreadable
    file, or a name stored twice."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(not_a_folder(folder))
    files = _safetensors_files(folder)
    out: dict[str, TensorInfo] = {}
    if files:
        from safetensors import safe_open

        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    infos = [(name, f.get_slice(name)) for name in f.keys()]
                    infos = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in infos]
            except Exception as e:  # noqa: BLE001 - any unreadable file is one line naming it
                raise CheckpointError(f"cannot read {path} as safetensors: {_first_line(e)}") from None
            for name, shape, dtype in infos:
                _add(out, TensorInfo(path, name, shape, dtype))
        if files != [folder / SAFETENSORS]:   # the shards an index names
            _check_complete(folder, out)
        return out
    path = folder / TORCH_BIN
    if not path.is_file():
        raise CheckpointError(f"{folder} holds no {SAFETENSORS}, {SAFETENSORS_INDEX} or {TORCH_BIN}")
    for name, t in _load_bin(path).items():
        _add(out, TensorInfo(path, name, tuple(t.shape), str(t.dtype)))
    return out


def _check_complete(folder: Path, tensors: dict[str, TensorInfo]) -> None:
    """Every name the index maps is in the file it maps it to."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return
    for name, file in json.loads(index.read_text())["weight_map"].items():
        info = tensors.get(_bare(name))
        if info is None or info.file.name != file:
            raise CheckpointError(f"{index} maps '{name}' to {file}, which does not hold it")


def _add(out: dict[str, TensorInfo], info: TensorInfo) -> None:
    bare = _bare(info.name)
    if bare in out:
        raise CheckpointError(f"tensor '{info.name}' is stored twice ({out[bare].file.name}, {info.file.name})")
    out[bare] = info


def _bare(name: str) -> str:
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is the same user-facing problem
        raise CheckpointError(f"cannot load {path} as a state dict: {_first_line(e)}") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{path} is not a state dict of named tensors")
    return state


def read_tensor(info: TensorInfo) -> torch.Tensor:
    """One tensor, as stored (CPU)."""
    if info.file.name == TORCH_BIN:
        return _load_bin(info.file)[info.name]
    from safetensors import safe_open

    with safe_open(str(info.file), framework="pt") as f:
        return f.get_tensor(info.name)


def load_hf_weights(folder: str | Path, config: dict) -> dict[str, torch.Tensor]:
    """The folder's weights under bare names, as stored; a tied head is the embedding itself."""
    folder = Path(folder)
    tensors = list_tensors(folder)
    if (folder / TORCH_BIN).is_file() and not any(i.file.suffix == ".safetensors" for i in tensors.values()):
        state = {_bare(k): v for k, v in _load_bin(folder / TORCH_BIN).items()}
    else:
        from safetensors.torch import load_file

        state = {}
        for path in sorted({i.file for i in tensors.values()}):
            state.update({_bare(k): v for k, v in load_file(str(path)).items()})
    if conventions(config).tied:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


def save_hf_weights(weights: dict[str, torch.Tensor], folder: str | Path, config: dict) -> Path:
    """Bare-named weights as an HF folder's model.safetensors (the tied head not stored)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = conventions(config).tied
    out = {(k if k == "lm_head.weight" else HF_PREFIX + k): v.contiguous() for k, v in weights.items()
           if not (tied and k == "lm_head.weight")}
    save_file(out, str(folder / SAFETENSORS))
    return folder / SAFETENSORS


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths above original/low_freq_factor divided by the
    factor, below original/high_freq_factor kept, a linear blend in between."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_max_positions / s.low_freq_factor
    high_wavelen = s.original_max_positions / s.high_freq_factor
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / s.factor,
                       torch.where(wavelen < high_wavelen, inv_freq, blended))
