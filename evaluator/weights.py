"""Random weights in the layout of SPEC.md §1: float32, bare key names, untied lm_head (and,
for a Hugging Face config, the biases, q/k norms and tying its conventions name:
evaluator/checkpoint.py).

Toy weights (`randn * 0.02`, norms all ones) are what the public run uses; the stress suite
draws larger scales and non-unit norms from the same function, so that an engine cannot
lean on the toy init (nearly uniform attention, tiny logits).
"""
from __future__ import annotations

from pathlib import Path

import torch

from evaluator.checkpoint import Conventions, conventions
from evaluator.common import ModelDims

TOY_SCALE = 0.02
DEFAULT_SEED = 0


def weight_shapes(dims: ModelDims, conv: Conventions = Conventions()) -> dict[str, tuple[int, ...]]:
    """Every key the weight files hold and its shape, in a fixed order (the draw order); a
    tied head is not stored."""
    h, q, kv, i = dims.hidden, dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.intermediate
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (dims.vocab, h)}
    for layer in range(dims.layers):
        p = f"layers.{layer}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
        })
        if conv.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if conv.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (dims.head_dim,),
                           p + "self_attn.k_norm.weight": (dims.head_dim,)})
        shapes.update({
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    shapes["norm.weight"] = (h,)
    if not conv.tied:
        shapes["lm_head.weight"] = (dims.vocab, h)
    return shapes


def random_weights(config: dict, seed: int = DEFAULT_SEED, scale: float = TOY_SCALE,
                   norm_spread: float = 0.0) -> dict[str, torch.Tensor]:
    """Matrices and biases `randn * scale`; norm weights ones, or uniform in [1 - spread, 1 + spread];
    a tied head is the embedding itself.

    Deterministic in (config, seed, scale, norm_spread): one CPU generator, fixed key order.
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    conv = conventions(config)
    for key, shape in weight_shapes(ModelDims.from_config(config), conv).items():
        if len(shape) == 1 and not key.endswith(".bias"):
            w = torch.ones(shape)
            if norm_spread:
                w += (torch.rand(shape, generator=gen) * 2 - 1) * norm_spread
        else:
            w = torch.randn(shape, generator=gen) * scale
        out[key] = w.float().contiguous()
    if conv.tied:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def save_weights(weights: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write a state dict where an engine finds it (`<weight_dir>/model.pt`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, path)
    return path
