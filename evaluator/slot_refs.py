"""The reference ops of the slot unit checks (docs/design.md §5), one per slot function.

Written from SPEC §3 numerics, not copied from a template: the torch variants in
templates/kernels/ and these are two independent readings of the same contract, and the unit
checks (evaluator/slot_cases.py) compare every variant against these. The `*_magnitudes`
helpers say what an output's rounding error may scale with where it inherits the last-bit
freedom of larger intermediates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def ref_add_rmsnorm(x, residual, w, eps):
    r = x + residual
    return ref_rmsnorm(r, w, eps), r


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of x[N, H, D]; cos/sin[P, D/2] already in x's dtype."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


def ref_rope_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache):
    """Returns (q_rot, k_rot, new_k_cache, new_v_cache) without touching the inputs."""
    q_rot = ref_rope(q, cos, sin, positions)
    k_rot = ref_rope(k, cos, sin, positions)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[slot_mapping] = k_rot
    vc[slot_mapping] = v
    return q_rot, k_rot, kc, vc


def _ref_attention(q, k, v, scale, causal):
    """q[L, Hq, D], k/v[T, Hkv, D] → o[L, Hq, D], the reference's order of operations."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.matmul(qh, kh.float().transpose(-1, -2)) * scale
    if causal:
        L, T = q.shape[0], k.shape[0]
        mask = torch.ones(L, T, dtype=torch.bool, device=q.device).triu(T - L + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, vh).transpose(0, 1)


def ref_prefill_attention(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    start = 0
    for n in seq_lens:
        out[start:start + n] = _ref_attention(q[start:start + n], k[start:start + n], v[start:start + n],
                                              scale, causal=True)
        start += n
    return out


def ref_decode_attention(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    table = block_table.cpu()
    for b, n in enumerate(context_lens.cpu().tolist()):
        j = torch.arange(n)
        slots = (table[b, j // block_size].long() * block_size + j % block_size).to(q.device)
        out[b] = _ref_attention(q[b:b + 1], k_cache[slots], v_cache[slots], scale, causal=False)[0]
    return out


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def ref_linear(x, weight):
    """A plain projection: x[N,K] @ weight[O,K]^T, accumulated in fp32 and rounded once to dt."""
    return F.linear(x, weight)


def ref_linear_silu(x, weight):
    """The MLP's gate/up projection and SwiGLU: weight[2I,K] holds gate (rows :I) over up (rows I:);
    silu(gate) * up as the silu_mul slot rounds it, [N, I]."""
    return ref_silu_mul(F.linear(x, weight))


def ref_linear_add_norm(x, weight, residual, norm_w, eps):
    """A sublayer's output projection, its residual add and the norm after it: (y, new_residual)."""
    r = residual + F.linear(x, weight)
    return ref_rmsnorm(r, norm_w, eps), r


def ref_linear_rope_cache(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
    """The QKV projection, RoPE on its q and k heads and the cache writes (Hkv, D from k_cache):
    (qkv with q and k rotated, new_k_cache, new_v_cache), the inputs untouched."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    qkv = F.linear(x, weight).view(x.shape[0], -1, head_dim)
    q, k, v = qkv.split([qkv.shape[1] - 2 * kv_heads, kv_heads, kv_heads], dim=1)
    q_rot, k_rot, kc, vc = ref_rope_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache)
    return torch.cat([q_rot, k_rot, v], dim=1).flatten(1), kc, vc


def rope_cache_magnitudes(x, weight, slot_mapping, k_cache, v_cache):
    """What an error in each of linear_rope_cache's outputs (qkv, k_cache, v_cache) may scale with:
    for a rotated (q or k) element, the larger of its pair (e, o) before the rotation; else the
    element itself. A rotated value can be small while its inputs are large, and each input is
    free in its last bit (the GEMM's fp32 sums run in another order than the reference's)."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    pre = F.linear(x, weight).float().abs().view(x.shape[0], -1, head_dim)
    mag = torch.maximum(pre[..., 0::2], pre[..., 1::2]).repeat_interleave(2, dim=-1)
    heads = pre.shape[1]
    mag[:, heads - kv_heads:] = pre[:, heads - kv_heads:]
    kc, vc = torch.zeros_like(k_cache, dtype=torch.float32), torch.zeros_like(v_cache, dtype=torch.float32)
    kc[slot_mapping] = mag[:, heads - 2 * kv_heads:heads - kv_heads]
    vc[slot_mapping] = mag[:, heads - kv_heads:]
    return [mag.flatten(1), kc, vc]


def linear_silu_magnitudes(x, weight):
    """What an error in linear_silu's output may scale with: gate and up are each free in their last
    bit (the GEMM's fp32 sums run in another order than cuBLAS's), and silu(g) * u moves by
    |u| * |silu(g)| for a relative step in u and |u| * |g silu'(g)| for one in g: five times |a| at
    g = -5. (An H100 fresh seed, N=64 K=2048 fp16: one element in 98304 three ulps off, against the
    plain atol + rtol * |a|.)"""
    gate_up = F.linear(x, weight).float()
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    sig = torch.sigmoid(g)
    return [u.abs() * ((g * sig).abs() + (g * sig * (1 + g * (1 - sig))).abs())]
