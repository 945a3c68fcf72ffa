"""Hand-written variants for testing evaluator.slot_check itself (CPU and CUDA).

CORRECT: one right variant per slot, written differently from slot_check's references
(padded gathers, pair reshapes), so that the check is seen to accept correct code it did
not write. WRONG: the classic mistakes, each of which the check must reject.
All are plain torch, so they run wherever torch does.
"""

CORRECT = {
    "norm": '''# slot: norm    variant: test_ok    devices: cpu, cuda
def rmsnorm__test_ok(x, w, eps):
    xf = x.float()
    inv = 1.0 / torch.sqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (xf * inv).to(x.dtype) * w


def add_rmsnorm__test_ok(x, residual, w, eps):
    r = x + residual
    return rmsnorm__test_ok(r, w, eps), r
''',
    "rope_cache": '''# slot: rope_cache    variant: test_ok    devices: cpu, cuda
def _rot_test_ok(x, cos, sin, positions):
    pairs = x.unflatten(-1, (-1, 2))
    e, o = pairs[..., 0], pairs[..., 1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    out = torch.empty_like(pairs)
    out[..., 0] = e * c - o * s
    out[..., 1] = e * s + o * c
    return out.flatten(-2)


def rope_cache__test_ok(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache):
    q.copy_(_rot_test_ok(q, cos, sin, positions))
    k.copy_(_rot_test_ok(k, cos, sin, positions))
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)
''',
    "prefill_attention": '''# slot: prefill_attention    variant: test_ok    devices: cpu, cuda
def prefill_attention__test_ok(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
    n, hq, d = q.shape
    group = hq // k.shape[1]
    out = q.new_empty(n, hq, d)
    start = 0
    for length in seq_lens:
        sl = slice(start, start + length)
        for h in range(hq):
            qh = q[sl, h].float()
            kh = k[sl, h // group].float()
            s = (qh @ kh.T) * scale
            s = s.masked_fill(torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
            out[sl, h] = torch.softmax(s, -1).to(q.dtype) @ v[sl, h // group]
        start += length
    return out


def _pairs_test_ok(x, cos, sin, positions):
    e, o = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)


def prefill_attention_rope_cache__test_ok(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache,
                                          cu_seqlens, seq_lens, max_seqlen, scale):
    k_rot = _pairs_test_ok(k, cos, sin, positions)
    k_cache.index_copy_(0, slot_mapping, k_rot)
    v_cache.index_copy_(0, slot_mapping, v)
    return prefill_attention__test_ok(_pairs_test_ok(q, cos, sin, positions), k_rot, v, cu_seqlens, seq_lens,
                                      max_seqlen, scale)
''',
    "decode_attention": '''# slot: decode_attention    variant: test_ok    devices: cpu, cuda
def decode_attention__test_ok(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    j = torch.arange(max_context, device=q.device)
    cols = (j // block_size).clamp(max=block_table.shape[1] - 1)
    slots = block_table[:, cols].long() * block_size + j % block_size           # [B, T]
    valid = j[None, :] < context_lens[:, None].long()                           # [B, T]
    kk = k_cache[slots].repeat_interleave(hq // hkv, dim=2)                     # [B, T, Hq, D]
    vv = v_cache[slots].repeat_interleave(hq // hkv, dim=2)
    vv = torch.where(valid[:, :, None, None], vv, torch.zeros_like(vv))         # NaN-poisoned slots
    s = torch.einsum("bhd,bthd->bht", q.float(), kk.float()) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.einsum("bht,bthd->bhd", p.float(), vv.float()).to(q.dtype)
''',
    "silu_mul": '''# slot: silu_mul    variant: test_ok    devices: cpu, cuda
def silu_mul__test_ok(gate_up):
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u
''',
    "linear": '''# slot: linear    variant: test_ok    devices: cpu, cuda
def _mm_test_ok(x, weight):
    return (x.float() @ weight.float().t()).to(x.dtype)


def linear__test_ok(x, weight):
    return _mm_test_ok(x, weight)


def linear_silu__test_ok(x, weight):
    i = weight.shape[0] // 2
    g = _mm_test_ok(x, weight[:i]).float()
    return (g * torch.sigmoid(g)).to(x.dtype) * _mm_test_ok(x, weight[i:])


def linear_add_norm__test_ok(x, weight, residual, norm_w, eps):
    r = residual + _mm_test_ok(x, weight)
    rf = r.float()
    return (rf / torch.sqrt((rf * rf).sum(-1, keepdim=True) / r.shape[-1] + eps)).to(r.dtype) * norm_w, r

def linear_rope_cache__test_ok(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    qkv = _mm_test_ok(x, weight)
    heads = qkv.view(x.shape[0], -1, d)
    turned = heads[:, :heads.shape[1] - kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    e, o = turned[..., 0::2].clone(), turned[..., 1::2].clone()
    turned[..., 0::2], turned[..., 1::2] = e * c - o * s, e * s + o * c
    k_cache[slot_mapping] = heads[:, -2 * kv_heads:-kv_heads]
    v_cache[slot_mapping] = heads[:, -kv_heads:]
    return qkv
''',
}

WRONG = {
    ("norm", "wrong_no_weight"): '''# slot: norm    variant: wrong_no_weight    devices: cpu, cuda
def rmsnorm__wrong_no_weight(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rmsnorm__wrong_no_weight(x, residual, w, eps):
    r = x + residual
    return rmsnorm__wrong_no_weight(r, w, eps), r
''',
    ("norm", "wrong_stale_residual"): '''# slot: norm    variant: wrong_stale_residual    devices: cpu, cuda
def rmsnorm__wrong_stale_residual(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def add_rmsnorm__wrong_stale_residual(x, residual, w, eps):
    return rmsnorm__wrong_stale_residual(x + residual, w, eps), residual
''',
    ("rope_cache", "wrong_rotate_half"): '''# slot: rope_cache    variant: wrong_rotate_half    devices: cpu, cuda
def _rot_half(x, cos, sin, positions):
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_cache__wrong_rotate_half(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache):
    q.copy_(_rot_half(q, cos, sin, positions))
    k.copy_(_rot_half(k, cos, sin, positions))
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v
''',
    ("rope_cache", "wrong_cache_before_rope"): '''# slot: rope_cache    variant: wrong_cache_before_rope    devices: cpu, cuda
def _rot(x, cos, sin, positions):
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), -1).flatten(-2)


def rope_cache__wrong_cache_before_rope(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache):
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v
    q.copy_(_rot(q, cos, sin, positions))
    k.copy_(_rot(k, cos, sin, positions))
''',
    ("prefill_attention", "wrong_no_causal"): '''# slot: prefill_attention    variant: wrong_no_causal    devices: cpu, cuda
def prefill_attention__wrong_no_causal(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = q.shape[1] // k.shape[1]
    start = 0
    for n in seq_lens:
        qs = q[start:start + n].transpose(0, 1).float()
        ks = k[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        p = torch.softmax(qs @ ks.float().transpose(1, 2) * scale, -1).to(q.dtype)
        out[start:start + n] = (p @ vs).transpose(0, 1)
        start += n
    return out
''',
    ("prefill_attention", "wrong_gqa_modulo"): '''# slot: prefill_attention    variant: wrong_gqa_modulo    devices: cpu, cuda
def prefill_attention__wrong_gqa_modulo(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    hq, hkv = q.shape[1], k.shape[1]
    idx = torch.arange(hq, device=q.device) % hkv        # wrong: the reference uses h // (hq // hkv)
    start = 0
    for n in seq_lens:
        qs = q[start:start + n].transpose(0, 1).float()
        ks = k[start:start + n].transpose(0, 1)[idx]
        vs = v[start:start + n].transpose(0, 1)[idx]
        s = qs @ ks.float().transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out[start:start + n] = (torch.softmax(s, -1).to(q.dtype) @ vs).transpose(0, 1)
        start += n
    return out
''',
    ("decode_attention", "wrong_ignores_context_lens"): '''# slot: decode_attention    variant: wrong_ignores_context_lens    devices: cpu, cuda
def decode_attention__wrong_ignores_context_lens(q, k_cache, v_cache, block_table, context_lens, max_context,
                                                 block_size, scale):
    # reads every slot of every block in the table, as if each request filled its blocks
    b, hq, d = q.shape
    group = hq // k_cache.shape[1]
    j = torch.arange(block_table.shape[1] * block_size, device=q.device)
    slots = block_table[:, j // block_size].long() * block_size + j % block_size
    kk = k_cache[slots].repeat_interleave(group, dim=2).float()
    vv = v_cache[slots].repeat_interleave(group, dim=2)
    p = torch.softmax(torch.einsum("bhd,bthd->bht", q.float(), kk) * scale, -1).to(q.dtype)
    return torch.einsum("bht,bthd->bhd", p.float(), vv.float()).to(q.dtype)
''',
    ("decode_attention", "wrong_fixed_scale"): '''# slot: decode_attention    variant: wrong_fixed_scale    devices: cpu, cuda
def decode_attention__wrong_fixed_scale(q, k_cache, v_cache, block_table, context_lens, max_context,
                                        block_size, scale):
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[1]
    for i, n in enumerate(context_lens.tolist()):
        j = torch.arange(n, device=q.device)
        slots = block_table[i, j // block_size].long() * block_size + j % block_size
        kk = k_cache[slots].repeat_interleave(group, dim=1).float()
        vv = v_cache[slots].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[i].float(), kk) / math.sqrt(q.shape[-1])   # ignores `scale`
        p = torch.softmax(s, -1).to(q.dtype)
        out[i] = torch.einsum("ht,thd->hd", p.float(), vv.float()).to(q.dtype)
    return out
''',
    ("silu_mul", "wrong_swapped"): '''# slot: silu_mul    variant: wrong_swapped    devices: cpu, cuda
def silu_mul__wrong_swapped(gate_up):
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, i:]) * gate_up[:, :i]
''',
}

# The linear slot's wrong variants: its four functions written right ({v}: the variant's name),
# with one of them swapped for a wrong one in each fixture below.
_LINEAR_RIGHT = {
    "linear": '''def linear__{v}(x, weight):
    return F.linear(x, weight)
''',
    "linear_silu": '''def linear_silu__{v}(x, weight):
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return F.silu(gate) * up
''',
    "linear_add_norm": '''def linear_add_norm__{v}(x, weight, residual, norm_w, eps):
    r = residual + F.linear(x, weight)
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype) * norm_w, r
''',
    "linear_rope_cache": '''def linear_rope_cache__{v}(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    qkv = F.linear(x, weight)
    heads = qkv.view(x.shape[0], -1, d)
    turned = heads[:, :heads.shape[1] - kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    e, o = turned[..., 0::2].clone(), turned[..., 1::2].clone()
    turned[..., 0::2], turned[..., 1::2] = e * c - o * s, e * s + o * c
    k_cache[slot_mapping] = heads[:, -2 * kv_heads:-kv_heads]
    v_cache[slot_mapping] = heads[:, -kv_heads:]
    return qkv
''',
}


def _wrong_fused_prefill(variant: str, wrong: str) -> str:
    """The right prefill_attention (CORRECT's) with a wrong prefill_attention_rope_cache."""
    right = CORRECT["prefill_attention"]
    plain = right[:right.index("def _pairs_test_ok(")].replace("test_ok", variant)
    return plain + wrong.replace("{v}", variant)


WRONG.update({("prefill_attention", variant): _wrong_fused_prefill(variant, wrong) for variant, wrong in (
    ("wrong_fused_rotate_half", """def prefill_attention_rope_cache__{v}(q, k, v, cos, sin, positions, slot_mapping, k_cache,
                                    v_cache, cu_seqlens, seq_lens, max_seqlen, scale):
    def rot(x):
        half = x.shape[-1] // 2
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        a, b = x[..., :half], x[..., half:]
        return torch.cat((a * c - b * s, a * s + b * c), -1)
    k_cache[slot_mapping] = rot(k)
    v_cache[slot_mapping] = v
    return prefill_attention__{v}(rot(q), rot(k), v, cu_seqlens, seq_lens, max_seqlen, scale)
"""),
    ("wrong_fused_cache_unrotated", """def prefill_attention_rope_cache__{v}(q, k, v, cos, sin, positions, slot_mapping, k_cache,
                                        v_cache, cu_seqlens, seq_lens, max_seqlen, scale):
    def rot(x):
        e, o = x[..., 0::2], x[..., 1::2]
        c, s = cos[positions][:, None, :], sin[positions][:, None, :]
        return torch.stack((e * c - o * s, e * s + o * c), -1).flatten(-2)
    k_cache[slot_mapping] = k
    v_cache[slot_mapping] = v
    return prefill_attention__{v}(rot(q), rot(k), v, cu_seqlens, seq_lens, max_seqlen, scale)
"""))})


def _wrong_linear(variant: str, fn: str, wrong: str) -> str:
    """A linear variant's module text: _LINEAR_RIGHT with function `fn` replaced by `wrong`."""
    bodies = {**_LINEAR_RIGHT, fn: wrong}
    text = "\n\n".join(bodies[name].replace("{v}", variant) for name in _LINEAR_RIGHT)
    return f"# slot: linear    variant: {variant}    devices: cpu, cuda\n" + text


WRONG.update({("linear", variant): _wrong_linear(variant, fn, wrong) for variant, fn, wrong in (
    ("wrong_norm_unweighted", "linear_add_norm", '''def linear_add_norm__{v}(x, weight, residual, norm_w, eps):
    r = residual + F.linear(x, weight)
    rf = r.float()
    return (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype), r   # wrong: no * norm_w
'''),
    ("wrong_silu_on_up", "linear_silu", '''def linear_silu__{v}(x, weight):
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    return gate * F.silu(up)          # wrong: silu belongs on the gate rows (the first half of weight)
'''),
    ("wrong_stale_residual", "linear_add_norm", '''def linear_add_norm__{v}(x, weight, residual, norm_w, eps):
    r = residual + F.linear(x, weight)
    rf = r.float()
    normed = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(r.dtype) * norm_w
    return normed, residual           # wrong: the new residual is the sum r
'''),
    ("wrong_weight_tail", "linear", '''def linear__{v}(x, weight):
    # wrong: a tiled kernel that drops the last partial K block (here: the K % 64 tail columns)
    k = x.shape[1] - x.shape[1] % 64
    return F.linear(x[:, :k], weight[:, :k])
'''),
    ("wrong_rope_rotate_half", "linear_rope_cache", '''def linear_rope_cache__{v}(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
    kv_heads, d = k_cache.shape[1], k_cache.shape[2]
    qkv = F.linear(x, weight)
    heads = qkv.view(x.shape[0], -1, d)
    turned = heads[:, :heads.shape[1] - kv_heads]
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    # wrong: Hugging Face's rotate-half pairs (x[:d/2], x[d/2:]), not the reference's interleaved ones
    e, o = turned[..., :d // 2].clone(), turned[..., d // 2:].clone()
    turned[..., :d // 2], turned[..., d // 2:] = e * c - o * s, e * s + o * c
    k_cache[slot_mapping] = heads[:, -2 * kv_heads:-kv_heads]
    v_cache[slot_mapping] = heads[:, -kv_heads:]
    return qkv
'''),
)})
