"""A Hugging Face model folder checked against its ModelSpec, lazily: headers first (every
file present and whole, every tensor named and shaped as the config says), then one tensor at
a time for finiteness, so a folder several times the RAM is checked in bounded memory.

The reading itself is the evaluator's (evaluator/checkpoint.py: the judge reads folders by the
same rules); this module turns what it finds into the agent's one-line SpecErrors.
"""
from __future__ import annotations

import re
from dataclasses import replace

import torch

from agent.spec import defaulted_hint
from evaluator.checkpoint import HF_PREFIX, CheckpointError, TensorInfo, list_tensors, read_tensor

# Stored dtypes an engine casts from: safetensors' names and torch's.
FLOAT_DTYPES = ("F32", "F16", "BF16", "torch.float32", "torch.float16", "torch.bfloat16")
_LAYER = re.compile(r"layers\.(\d+)\.")


def stored_name(bare: str) -> str:
    """The name a transformers checkpoint gives a bare key (lm_head carries no prefix)."""
    return bare if bare == "lm_head.weight" else HF_PREFIX + bare


def check_hf_weights(spec, error: type[Exception]):
    """`spec` with parameters and warnings filled in, or `error` (SpecError) naming the file
    and tensor of the first problem."""
    try:
        tensors = list_tensors(spec.weight_dir)
    except CheckpointError as e:
        raise error(str(e)) from None
    expected = spec.expected_shapes()
    params = 0
    for key, shape in expected.items():
        info = tensors.get(key)
        if info is None:
            raise error(f"missing tensor '{stored_name(key)}' in {spec.weight_dir}")
        if info.dtype not in FLOAT_DTYPES:
            raise error(f"'{info.name}' in {info.file} has dtype {info.dtype}, expected bf16, fp16 or fp32")
        if info.shape != shape:
            raise error(f"'{info.name}' in {info.file} has shape {list(info.shape)}, expected {list(shape)} "
                        f"from the model config{defaulted_hint(spec, key)}")
        params += _numel(shape)
    _check_finite([tensors[k] for k in expected], error)
    if spec.conventions.tied and "lm_head.weight" in tensors:
        _check_tied_head(tensors["lm_head.weight"], tensors["embed_tokens.weight"], error)
    ignored = {"lm_head.weight"} if spec.conventions.tied else set()
    extra = sorted(k for k in tensors if k not in expected and k not in ignored)
    warnings = list(spec.warnings)
    if extra:
        beyond = [k for k in extra if (m := _LAYER.match(k)) and int(m.group(1)) >= spec.layers]
        why = f" (layers beyond num_hidden_layers={spec.layers}?)" if beyond else ""
        warnings.append(f"{len(extra)} unexpected tensor(s) ignored{why}, e.g. '{tensors[extra[0]].name}'")
    return replace(spec, parameters=params, warnings=tuple(warnings))


def _check_tied_head(head: TensorInfo, embed: TensorInfo, error: type[Exception]) -> None:
    """A tied model that stores an lm_head anyway: fine where it is the embedding. Where it is not,
    transformers 5 uses the stored head and older versions tie it away, so which model the
    folder is depends on the reader: refused, naming both tensors."""
    if head.shape != embed.shape or not torch.equal(read_tensor(head), read_tensor(embed)):
        raise error(f"tie_word_embeddings is true, but '{head.name}' in {head.file} is not '{embed.name}': "
                    "transformers versions disagree on which is the output head")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check_finite(infos: list[TensorInfo], error: type[Exception]) -> None:
    """Every tensor finite, read one at a time through one handle per file."""
    by_file: dict = {}
    for info in infos:
        by_file.setdefault(info.file, []).append(info)
    for path, group in by_file.items():
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:
                    for info in group:
                        _finite(f.get_tensor(info.name), info, error)
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                for info in group:
                    _finite(state[info.name], info, error)
        except error:
            raise
        except Exception as e:  # noqa: BLE001 - a file that breaks mid-read is one line naming it
            raise error(f"cannot read {path}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else e!r}"
                        ) from None


def _finite(t: torch.Tensor, info: TensorInfo, error: type[Exception]) -> None:
    if not bool(torch.isfinite(t).all()):
        raise error(f"'{info.name}' in {info.file} has non-finite values (nan or inf)")
