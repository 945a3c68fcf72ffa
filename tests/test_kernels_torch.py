"""The torch variant of every kernel slot against its contract (docs/design.md §5), each checked
with math written independently: per-head loops, explicit formulas, dense contexts.

These variants are the CPU path of every engine and the reference the CUDA variants are
compared with, so they are held to fp32 agreement here.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agent.plan import Variant, parse_header
from evaluator.slot_render import kernel_path, render_slot_module
from evaluator.slots import SLOTS

ATOL = 1e-5


def load(slot: str) -> dict:
    namespace: dict = {}
    exec(compile(render_slot_module(slot, "torch"), f"<{slot}/torch>", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def kernels() -> dict:
    out = {}
    for slot in SLOTS:
        out.update(load(slot))
    return out


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_headers_name_slot_and_devices():
    for slot in SLOTS:
        text = kernel_path(slot, "torch").read_text()
        assert text.splitlines()[0] == f"# slot: {slot}    variant: torch    devices: cpu, cuda"
        graph_safe = slot not in ("decode_attention", "prefill_attention")   # they loop on the host: `# graphs: no`
        assert parse_header(text) == Variant(slot, "torch", ("cpu", "cuda"), None, graph_safe=graph_safe)


def test_rmsnorm_and_add_rmsnorm(kernels):
    g = gen()
    x, res, w = torch.randn(5, 24, generator=g), torch.randn(5, 24, generator=g), torch.rand(24, generator=g) + 0.5
    eps = 1e-5
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 24 + eps) * w
    assert torch.allclose(kernels["rmsnorm__torch"](x, w, eps), expected, atol=ATOL)
    x0, res0 = x.clone(), res.clone()
    y, r = kernels["add_rmsnorm__torch"](x, res, w, eps)
    assert torch.equal(r, x0 + res0) and torch.equal(x, x0) and torch.equal(res, res0)
    s = x0 + res0
    assert torch.allclose(y, s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * w, atol=ATOL)


def test_rmsnorm_rounds_to_dtype_before_weight(kernels):
    x = torch.randn(3, 16, generator=gen(1)).half()
    w = (torch.rand(16, generator=gen(2)) + 0.5).half()
    y = kernels["rmsnorm__torch"](x, w, 1e-5)
    xf = x.float()
    assert y.dtype == torch.float16
    assert torch.equal(y, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).half() * w)


def test_silu_mul(kernels):
    gu = torch.randn(4, 2 * 10, generator=gen())
    gate, up = gu[:, :10], gu[:, 10:]
    expected = gate / (1 + torch.exp(-gate)) * up
    assert torch.allclose(kernels["silu_mul__torch"](gu), expected, atol=ATOL)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (4, 2, 24), (6, 1, 10)])
def test_rope_cache_on_strided_views(kernels, heads, kv_heads, dim):
    g = gen()
    n, slots_total, positions_total = 7, 40, 50
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].unflatten(1, (heads, dim))
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].unflatten(1, (kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim:].unflatten(1, (kv_heads, dim))
    q0, k0, v0 = q.clone(), k.clone(), v.clone()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(positions_total).float()[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 1, 2, 9, 31, 49, 5])
    slot_mapping = torch.tensor([3, 0, 39, 17, 16, 8, 22])
    k_cache, v_cache = torch.zeros(slots_total, kv_heads, dim), torch.zeros(slots_total, kv_heads, dim)
    kernels["rope_cache__torch"](q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache)

    def rotate(x):
        out = torch.empty_like(x)
        for t in range(n):
            p = positions[t].item()
            for i in range(dim // 2):
                c, s = math.cos(p * inv_freq[i].item()), math.sin(p * inv_freq[i].item())
                e, o = x[t, :, 2 * i], x[t, :, 2 * i + 1]
                out[t, :, 2 * i], out[t, :, 2 * i + 1] = e * c - o * s, e * s + o * c
        return out

    assert torch.allclose(q, rotate(q0), atol=1e-4)
    assert torch.allclose(k, rotate(k0), atol=1e-4)
    assert torch.equal(v, v0)
    assert torch.equal(k_cache[slot_mapping], k) and torch.equal(v_cache[slot_mapping], v0)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def dense_attention(q, k, v, scale, causal):
    """q[Lq,Hq,D], k/v[Lk,Hkv,D]; one head at a time; causal aligns the last query with the last key."""
    lq, heads, _ = q.shape
    lk, kv_heads = k.shape[0], k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        s = q[:, h].float() @ k[:, kh].float().T * scale
        if causal:
            mask = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
            s = s.masked_fill(mask, float("-inf"))
        out[:, h] = F.softmax(s, -1).to(q.dtype) @ v[:, kh]
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (4, 2, 24), (6, 1, 10)])
def test_prefill_attention_varlen(kernels, heads, kv_heads, dim):
    g = gen()
    seq_lens = [1, 9, 4, 17]
    n = sum(seq_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)
    q = qkv[:, :heads * dim].unflatten(1, (heads, dim))
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].unflatten(1, (kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim:].unflatten(1, (kv_heads, dim))
    cu = torch.tensor([0, 1, 10, 14, 31], dtype=torch.int32)
    scale = 1 / math.sqrt(dim)
    out = kernels["prefill_attention__torch"](q, k, v, cu, seq_lens, max(seq_lens), scale)
    assert out.shape == (n, heads, dim)
    for i, length in enumerate(seq_lens):
        a, b = cu[i].item(), cu[i + 1].item()
        assert b - a == length
        assert torch.allclose(out[a:b], dense_attention(q[a:b], k[a:b], v[a:b], scale, True), atol=ATOL)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (4, 2, 24), (6, 1, 10)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_paged(kernels, heads, kv_heads, dim, block_size):
    g = gen()
    context_lens = [1, block_size, block_size + 1, 3 * block_size + 2]
    batch, num_blocks = len(context_lens), 32
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()   # block 0 is never a context's
    max_blocks = 6
    # Past each context the table holds garbage: block 0 (poisoned with NaN) or out of range.
    block_table = torch.tensor([[0, 10**6] * (max_blocks // 2)] * batch, dtype=torch.int32)
    for b, length in enumerate(context_lens):
        for j in range(-(-length // block_size)):
            block_table[b, j] = perm.pop()
    k_cache[:block_size] = float("nan")
    v_cache[:block_size] = float("nan")
    q = torch.randn(batch, heads, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    max_context = max_blocks * block_size
    out = kernels["decode_attention__torch"](q, k_cache, v_cache, block_table,
                                             torch.tensor(context_lens, dtype=torch.int32),
                                             max_context, block_size, scale)
    for b, length in enumerate(context_lens):
        slots = [block_table[b, j // block_size].item() * block_size + j % block_size for j in range(length)]
        expected = dense_attention(q[b:b + 1], k_cache[slots], v_cache[slots], scale, causal=False)
        assert torch.allclose(out[b:b + 1], expected, atol=ATOL), f"request {b}"


def test_linear_slot(kernels):
    """linear: x @ W^T; linear_silu: W is gate rows over up rows, silu(gate) * up; linear_add_norm:
    (rmsnorm(residual + x @ W^T) * norm_w, residual + x @ W^T). Inputs are not modified."""
    g = gen(3)
    n, k, inter = 5, 24, 10
    x = torch.randn(n, k + 3, generator=g)[:, :k]           # a row-strided view, as the engine passes
    w = torch.randn(2 * inter, k, generator=g) / math.sqrt(k)
    residual, norm_w, eps = torch.randn(n, 2 * inter, generator=g), torch.rand(2 * inter, generator=g) + 0.5, 1e-5
    x0, w0, res0 = x.clone(), w.clone(), residual.clone()
    dot = torch.tensor([[sum(x[i, j].item() * w[o, j].item() for j in range(k)) for o in range(2 * inter)]
                        for i in range(n)])
    y = kernels["linear__torch"](x=x, weight=w)
    assert y.shape == (n, 2 * inter) and torch.allclose(y, dot, atol=ATOL)
    a = kernels["linear_silu__torch"](x=x, weight=w)
    gate, up = dot[:, :inter], dot[:, inter:]
    assert a.shape == (n, inter) and torch.allclose(a, gate / (1 + torch.exp(-gate)) * up, atol=ATOL)
    y, r = kernels["linear_add_norm__torch"](x=x, weight=w, residual=residual, norm_w=norm_w, eps=eps)
    s = res0 + dot
    assert torch.allclose(r, s, atol=ATOL)
    assert torch.allclose(y, s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * norm_w, atol=ATOL)
    assert torch.equal(x, x0) and torch.equal(w, w0) and torch.equal(residual, res0)
    half = kernels["linear_silu__torch"](x=x.half(), weight=w.half())
    assert half.dtype == torch.float16 and torch.allclose(half.float(), a, atol=2e-2)
