"""The reference numerics of SPEC.md §3: what "correct" means.

One request at a time, the whole token history recomputed on every call, written for
clarity, never for speed. Every rounding step the official judge makes is made here in the
same place, because in bf16 the margin between a correct engine and the tolerance is thin.

A Hugging Face config (evaluator/checkpoint.py) adds its conventions: rotate-half RoPE, llama3
frequency scaling, q/k/v biases, per-head q/k RMSNorm, a tied head; tests/test_hf_reference.py
holds this to `transformers`' own models.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from evaluator.checkpoint import Llama3Scaling, conventions, llama3_inv_freq
from evaluator.common import ModelDims, compute_dtype, load_weights, resolve_device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Upcast to fp32, normalise, cast back to the compute dtype, then scale by the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                scaling: Llama3Scaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [T, head_dim/2], computed in fp32 and then cast to the compute dtype."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=positions.device) / head_dim)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (pairwise) RoPE on x [T, heads, head_dim]: pairs are (x[0::2], x[1::2])."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


def apply_rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's RoPE on x [T, heads, head_dim]: pairs are (x[:D/2], x[D/2:])."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_div: float) -> torch.Tensor:
    """Causal attention of one request, q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq*D].

    Scores and softmax in fp32; probabilities rounded to the compute dtype before `@ v`.
    Query head h reads kv head h // (Hq // Hkv).
    """
    seq, heads, _ = q.shape
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    scores = (q.float() @ k.float().transpose(-1, -2)) / scale_div
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = probs.to(v.dtype) @ v
    return out.transpose(0, 1).reshape(seq, -1)


class ReferenceModel:
    """A plain PyTorch tiny-llama: weights cast to the compute dtype at load."""

    def __init__(self, model_config: dict, weights: dict[str, torch.Tensor], device: str = "auto",
                 dtype: torch.dtype | None = None):
        """dtype: the compute dtype of SPEC.md §3 unless given (evaluator/noise.py runs the same
        model in fp32, to see how far the judge's own rounding takes it)."""
        self.dims = ModelDims.from_config(model_config)
        self.conv = conventions(model_config)
        self.rope = apply_rope_rotate_half if self.conv.rope_style == "rotate_half" else apply_rope
        self.device = resolve_device(device)
        self.dtype = dtype or compute_dtype(model_config, self.device)
        self.w = {k: v.to(device=self.device, dtype=self.dtype) for k, v in weights.items()}

    @classmethod
    def load(cls, model_config: dict, weight_dir: str | Path, device: str = "auto",
             dtype: torch.dtype | None = None) -> "ReferenceModel":
        return cls(model_config, load_weights(weight_dir, model_config), device, dtype=dtype)

    @torch.no_grad()
    def final_hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last layer, before the final norm: [T, hidden]."""
        d, w = self.dims, self.w
        tokens = tokens.to(self.device).long().reshape(-1)
        seq = tokens.numel()
        cos, sin = rope_tables(torch.arange(seq, device=self.device), d.head_dim, d.theta, self.dtype,
                               self.conv.rope_scaling)
        x = F.embedding(tokens, w["embed_tokens.weight"])
        for i in range(d.layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], d.eps)
            a = p + "self_attn."
            q = F.linear(h, w[a + "q_proj.weight"], self._bias(a + "q_proj.bias")).view(seq, d.heads, d.head_dim)
            k = F.linear(h, w[a + "k_proj.weight"], self._bias(a + "k_proj.bias")).view(seq, d.kv_heads, d.head_dim)
            v = F.linear(h, w[a + "v_proj.weight"], self._bias(a + "v_proj.bias")).view(seq, d.kv_heads, d.head_dim)
            if self.conv.qk_norm:
                q, k = rms_norm(q, w[a + "q_norm.weight"], d.eps), rms_norm(k, w[a + "k_norm.weight"], d.eps)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            attn = attention(q, k, v, math.sqrt(d.head_dim))
            x = x + F.linear(attn, w[p + "self_attn.o_proj.weight"])
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], d.eps)
            gate = F.linear(h, w[p + "mlp.gate_proj.weight"])
            up = F.linear(h, w[p + "mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return x

    def _bias(self, name: str) -> torch.Tensor | None:
        """A q/k/v bias where the architecture has them (Qwen2); a Llama checkpoint that stores
        some anyway runs without, as transformers' Llama does (it never loads them)."""
        return self.w.get(name) if self.conv.qkv_bias else None

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.w["norm.weight"], self.dims.eps), self.w["lm_head.weight"])

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits at every position, [T, vocab], in the compute dtype."""
        return self._head(self.final_hidden(tokens))

    @torch.no_grad()
    def last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits at the last position, [vocab]: what an engine call returns for a request."""
        return self._head(self.final_hidden(tokens)[-1:])[0]
