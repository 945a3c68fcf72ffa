"""The paged engine skeleton against the SPEC §3 reference (evaluator/reference_model.py).

Every engine output is compared with the reference recomputed from the request's whole token
history. CPU tests use the torch variants in fp32 on tiny configs; the CUDA tests (skipped
without a GPU) repeat the traces in fp16 and bf16 with decode graphs on and off, for the torch
slots and for every CUDA variant on disk.
"""
from __future__ import annotations

import ast
import dataclasses
import random
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agent.plan import Plan, engine_params, menu
from agent.render import render_engine
from evaluator.reference_model import ReferenceModel
from evaluator.slots import SLOTS
from evaluator.weights import random_weights
from tests.conftest import load_source

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=16, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float16")
CPU_ATOL = 1e-4          # fp32 engine vs fp32 reference: only the order of operations differs
GPU_ATOL = GPU_RTOL = 1e-2   # the judge's tolerance
# Weight scales: large on CPU (fp32 costs nothing, attention far from uniform); on CUDA where the
# compute dtype's own rounding keeps a correct engine clear of the tolerance at hidden 64
# (fp16 k = hidden * s^2 ~ 0.25, bf16 ~ 0.08, as evaluator/stress.py draws them).
CPU_SCALE = 0.2
GPU_SCALE = {"float16": 0.06, "bfloat16": 0.035}
SMALL_CACHE = {"cache_tokens": 32, "block_size": 16}   # forces the pool to grow in every trace

def load_engine(plan: Plan):
    """The plan's engine, rendered and imported as a fresh module."""
    return load_source(render_engine(plan), "paged_engine_under_test")


def write_weights(weights, weight_dir):
    """<weight_dir>/model.pt, where every engine looks (SPEC §1)."""
    weight_dir.mkdir(parents=True, exist_ok=True)
    torch.save(weights, weight_dir / "model.pt")


def config(**overrides):
    return {**TINY, **overrides}


class Checked:
    """An engine and the reference side by side: every call's rows are checked against the
    reference run on the request's full history."""

    def __init__(self, plan, cfg, tmp_path, device="cpu", atol=CPU_ATOL, rtol=0.0, seed=0, scale=CPU_SCALE,
                 module=None):
        """module: the plan's engine module, already loaded (and perhaps patched); by default fresh."""
        weights = random_weights(cfg, seed=seed, scale=scale, norm_spread=0.5)
        write_weights(weights, tmp_path)
        self.engine = (module or load_engine(plan)).create_engine(cfg, str(tmp_path), device)
        self.reference = ReferenceModel(cfg, weights, device)
        self.device, self.vocab, self.atol, self.rtol = device, cfg["vocab_size"], atol, rtol
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.history: dict[int, list[int]] = {}
        self.worst = 0.0

    def tokens(self, n):
        return torch.randint(0, self.vocab, (n,), generator=self.gen, device=self.device)

    def prefill(self, ids, lengths, as_input=None):
        """as_input(t) -> what the engine gets (another device, dtype or layout): by default t."""
        prompts = [self.tokens(n) for n in lengths]
        for rid, p in zip(ids, prompts):
            self.history[rid] = p.tolist()
        self._check(ids, self.engine.prefill(ids, [as_input(p) for p in prompts] if as_input else prompts))

    def decode(self, ids, as_input=None):
        toks = self.tokens(len(ids))
        for rid, t in zip(ids, toks.tolist()):
            self.history[rid].append(t)
        self._check(ids, self.engine.decode(ids, as_input(toks) if as_input else toks))

    def remove(self, ids):
        self.engine.remove(ids)
        for rid in ids:
            self.history.pop(rid, None)

    def _check(self, ids, out):
        assert out.shape == (len(ids), self.vocab)
        out = out.float().cpu()
        for row, rid in enumerate(ids):
            ref = self.reference.last_logits(torch.tensor(self.history[rid])).float().cpu()
            err = (out[row] - ref).abs()
            self.worst = max(self.worst, err.max().item())
            assert torch.isfinite(out[row]).all()
            assert (err <= self.atol + self.rtol * ref.abs()).all(), \
                f"request {rid} (len {len(self.history[rid])}): max abs err {err.max().item():.3g}"


def public_sequence(c: Checked):
    """SPEC §4."""
    c.prefill([0], [11])
    c.decode([0])
    c.prefill([1, 2], [7, 13])
    c.decode([0, 1, 2])
    c.remove([1])
    c.prefill([3], [5])
    c.decode([0, 2, 3])
    c.remove([0, 2, 3])


def ragged_trace(c: Checked, steps=24, seed=1):
    """Ragged prefill with large non-contiguous ids, shuffled decode subsets, id reuse after
    remove, replacement of a live request, unknown ids in remove, everything removed and reused."""
    rng = random.Random(seed)
    ids = [7, 10**12 + 3, 42, 2**40]
    c.prefill(ids, [1, 17, 33, 16])
    for step in range(steps):
        live = list(c.history)
        c.decode(rng.sample(live, rng.randint(1, len(live))))
        if step == 6:
            c.remove([42, 999])
            c.prefill([42], [9])                      # id reuse
        if step == 12:
            c.prefill([7, 5], [20, 3])                # replace a live request, add a new one
    c.remove(list(c.history))
    c.prefill([7, 1], [4, 31])
    c.decode([1, 7])


def torch_plan(**params):
    return Plan("paged", slots={s: "torch" for s in SLOTS}, params=params)


# ---- template and plan plumbing ----

def test_header_params_match_template_defaults():
    declared = {name: p.default for name, p in engine_params("paged").items()}
    assert {"block_size", "decode_graphs", "max_graph_batch", "cache_tokens", "prefill_graphs",
            "max_graph_tokens"} <= set(declared)
    module = load_engine(Plan("paged"))           # no params: the template's own defaults
    assert module.BLOCK_SIZE == declared["block_size"]
    assert module.INITIAL_CACHE_TOKENS == declared["cache_tokens"]
    assert module.MAX_GRAPH_BATCH == declared["max_graph_batch"]
    assert module.MAX_GRAPH_TOKENS == declared["max_graph_tokens"]


KERNEL_PARAM_DEFAULT = re.compile(r"params\.get\(['\"](\w+)['\"], ([^)]+)\)")


def test_kernel_templates_default_the_skeletons_params_alike():
    """A kernel variant reads skeleton params (pdl, fused_reduce) from the plan's params, which may
    leave them out: each template's default must be the skeleton's `# param:` default, or an
    engine rendered without the param runs otherwise than the plan says (pdl turned on by default
    in the skeleton alone would have left every kernel without it)."""
    declared = {name: p.default for name, p in engine_params("paged").items()}
    seen = set()
    for path in sorted((Path(__file__).resolve().parents[1] / "templates" / "kernels").rglob("*.j2")):
        for name, default in KERNEL_PARAM_DEFAULT.findall(path.read_text()):
            if name in declared:
                assert ast.literal_eval(default) == declared[name], f"{path.name}: {name} defaults to {default}"
                seen.add(name)
    assert {"pdl", "fused_reduce"} <= seen
    source = render_engine(Plan("paged", {"linear": "triton", "decode_attention": "triton_split"}))
    assert "LINEAR_PDL__triton = True and PDL_SUPPORTED" in source
    assert "DECODE_PDL__triton_split = True and PDL_SUPPORTED" in source


def test_params_reach_the_engine():
    module = load_engine(torch_plan(block_size=32, cache_tokens=1024, max_graph_batch=16))
    assert (module.BLOCK_SIZE, module.INITIAL_CACHE_TOKENS, module.MAX_GRAPH_BATCH) == (32, 1024, 16)
    assert module.DECODE_GRAPHS is False          # the torch attention variants are not graph-safe
    assert load_engine(torch_plan(prefill_graphs=True)).PREFILL_GRAPHS is False


FUSED_REDUCE_SLOTS = {**{s: "torch" for s in SLOTS}, "linear": "triton", "decode_attention": "triton_split"}


def test_fused_reduce_reaches_the_kernels_and_the_cpu_engine_runs(tmp_path):
    """fused_reduce is read by the linear and split decode kernels (off by default); on the CPU the
    torch variants run whatever it says, and the engine still matches the reference."""
    assert engine_params("paged")["fused_reduce"].default is False
    assert load_engine(Plan("paged", FUSED_REDUCE_SLOTS)).LINEAR_FUSED__triton is False
    plan = Plan("paged", FUSED_REDUCE_SLOTS, {"fused_reduce": True})
    module = load_engine(plan)
    assert module.LINEAR_FUSED__triton is True and module.DECODE_FUSED__triton_split is True
    public_sequence(Checked(plan, config(), tmp_path))


def test_device_resolution_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("resolution to cpu is only observable without a GPU")
    write_weights(random_weights(TINY), tmp_path)
    module = load_engine(torch_plan())
    for device in ("auto", "cuda", "cpu"):
        assert module.create_engine(TINY, str(tmp_path), device).device == "cpu"


# ---- CPU: the torch variants against the reference ----

def test_public_sequence_cpu(tmp_path):
    public_sequence(Checked(torch_plan(), config(), tmp_path))


@pytest.mark.parametrize("engine", ["paged", "recompute"])
def test_a_legacy_weight_file_loads_where_it_cannot_be_mapped_cpu(tmp_path, monkeypatch, engine):
    """Engines map model.pt; a file torch saved in its old, non-zip format cannot be mapped, and
    is read whole instead. The check: such a file gives the same logits as the mapped one."""
    plan = torch_plan() if engine == "paged" else Plan("recompute")
    module = load_engine(plan)
    weights = random_weights(config(), seed=3, scale=CPU_SCALE, norm_spread=0.5)
    logits = []
    for legacy in (False, True):
        folder = tmp_path / str(legacy)
        folder.mkdir()
        torch.save(weights, folder / "model.pt", _use_new_zipfile_serialization=not legacy)
        eng = module.create_engine(config(), str(folder), "cpu")
        logits.append(eng.prefill([0], [torch.arange(9)]))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="mmap"):
        torch.load(tmp_path / "True" / "model.pt", weights_only=True, mmap=True)


@pytest.mark.parametrize("cfg", [
    config(),
    config(num_key_value_heads=2, head_dim=24),                # GQA, head_dim != hidden/heads
    config(num_key_value_heads=1, head_dim=40),                # MQA, D not a power of two
], ids=["mha", "gqa-d24", "mqa-d40"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_ragged_trace_cpu(tmp_path, cfg, block_size):
    c = Checked(torch_plan(block_size=block_size, cache_tokens=32), cfg, tmp_path)
    ragged_trace(c)
    assert c.engine.blocks.num_blocks * block_size > 64      # the pool grew past its start


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_cpu_projections_run_packed_for_onednn_or_plain(tmp_path, monkeypatch, packed):
    """On a CPU in fp32 the projection weights (and an untied lm_head) are laid out for oneDNN's
    linear where this torch can (cpu_packing_works), and stay plain where it cannot; both match
    the reference, in fused passes (decode, short prefills) and unfused ones (a long prefill)."""
    plan = torch_plan()
    module = load_engine(plan)
    if not packed:
        monkeypatch.setattr(module, "cpu_packing_works", lambda: False)
    elif not module.cpu_packing_works():
        pytest.skip("this torch cannot pack weights for oneDNN")
    c = Checked(plan, config(num_key_value_heads=2, head_dim=24), tmp_path, module=module)
    model = c.engine.model
    weights = [w for layer in model.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    assert all(w.is_mkldnn == packed for w in [*weights, model.lm_head])
    assert not model.embed.is_mkldnn
    c.prefill([0, 1], [700, 5])                  # 705 tokens: pieces of 512, 128, 64 and 1 (padded)
    for _ in range(3):
        c.decode([1, 0])
    ragged_trace(c, steps=6)


def resident_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc/self/status")
def test_a_packed_weight_stays_small_whatever_the_row_counts():
    """oneDNN keeps a kernel, with memory of its own, for every row count a packed weight is called
    with: called straight with 85 row counts up to 600, a 5.5 MB weight grew this process by
    hundreds of MB (1.4 GB with every count). Through dense it sees ten counts and stays small."""
    module = load_engine(torch_plan())
    if not module.cpu_packing_works():
        pytest.skip("this torch cannot pack weights for oneDNN")
    gen = torch.Generator().manual_seed(0)
    plain = torch.randn(2816, 512, generator=gen)
    weight = torch.ops.mkldnn._reorder_linear_weight(plain)
    x = torch.randn(600, 512, generator=gen)
    module.dense(x[:1], weight)
    before = resident_mb()
    for rows in range(2, 600, 7):
        out = module.dense(x[:rows], weight)
        assert out.shape == (rows, 2816)
    assert torch.allclose(out, F.linear(x[:rows], plain), rtol=1e-4, atol=1e-4)
    assert resident_mb() - before < 100


def test_packed_weights_see_ten_row_counts_at_most():
    """oneDNN keeps a kernel, with memory of its own, for every row count it is called with, so a
    packed weight's inputs are cut and padded to powers of two up to PACKED_ROWS: every row count
    splits into pieces that cover it exactly, each padded to a power of two no larger than that."""
    module = load_engine(torch_plan())
    seen = set()
    for rows in [*range(0, 1100), 4096, 5000, 16385]:
        position = 0
        for start, n, padded in module.packed_chunks(rows):
            assert start == position and 0 < n <= padded <= module.PACKED_ROWS and padded & (padded - 1) == 0
            position += n
            seen.add(padded)
        assert position == rows
    assert len(seen) <= 10


def test_long_prompt_and_positions_beyond_config_cpu(tmp_path):
    """A 1100-token prompt on a model whose config says 256 positions: RoPE tables, block table
    and pool all grow; decode continues across the growth."""
    c = Checked(torch_plan(**SMALL_CACHE), config(max_position_embeddings=256), tmp_path)
    c.prefill([0, 1], [1100, 5])
    for _ in range(3):
        c.decode([1, 0])
    assert c.engine.max_positions >= 1103


def test_long_prefill_runs_its_mlp_in_chunks_cpu(tmp_path, monkeypatch):
    """A pass longer than MLP_CHUNK_TOKENS runs gate/up, SiLU and down a chunk of tokens at a time
    (bounded activation memory); the outputs still match the reference."""
    c = Checked(torch_plan(), config(), tmp_path)
    module = sys.modules[type(c.engine).__module__]
    monkeypatch.setattr(module, "MLP_CHUNK_TOKENS", 50)
    calls = []
    kernels = c.engine.kernels
    counted = dataclasses.replace(kernels, silu_mul=lambda gu: calls.append(gu.shape[0]) or kernels.silu_mul(gu))
    c.engine.kernels = c.engine.model.kernels = counted
    c.prefill([0, 1], [130, 7])                      # 137 tokens: chunks of 50, 50, 37 in every layer
    c.decode([1, 0])
    assert calls[:3] == [50, 50, 37]


def test_a_prefill_grows_the_pool_once_for_the_whole_call_cpu(tmp_path, monkeypatch):
    """Prompts that together need several doublings of the pool grow it once (the H100 profile of
    a 1B model's 8 x 2048 prefill showed two growths, 64 host ops the GPU waited on); a re-prefill
    of a live id counts the blocks it gives back."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    grown = []
    grow = c.engine._grow_cache
    monkeypatch.setattr(c.engine, "_grow_cache", lambda n: grown.append(n) or grow(n))
    lengths = [int(n) for n in torch.randint(40, 90, (4,))]
    c.prefill([0, 1, 2, 3], lengths)
    assert len(grown) == 1 and c.engine.blocks.num_free() >= 0
    free = c.engine.blocks.num_free()
    c.prefill([2], [lengths[2]])                    # the same length again: its own blocks suffice
    assert len(grown) == 1 and c.engine.blocks.num_free() == free
    for _ in range(2):
        c.decode([0, 1, 2, 3])


def test_a_wide_prefill_leaves_room_for_the_next_decode_step_cpu(tmp_path, monkeypatch):
    """A prefill that needs more than a doubling grows the pool to fit it with headroom, so the
    next decode step, in which every request crosses into a new block, does not grow (copy) it
    again (on an H100 that second growth cost a 1B model's first decode step ~1.5 ms)."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    grown = []
    grow = c.engine._grow_cache
    monkeypatch.setattr(c.engine, "_grow_cache", lambda n: grown.append(n) or grow(n))
    ids = list(range(8))
    c.prefill(ids, [64] * len(ids))                 # 32 blocks against a pool of 2: one growth
    assert len(grown) == 1
    c.decode(ids)                                   # 8 more blocks: within a quarter of 33
    assert len(grown) == 1
    c.decode(ids)


def test_a_growth_with_no_block_held_drops_the_old_pool_first_cpu(tmp_path, monkeypatch):
    """A fresh engine's first long prefill: nothing to keep, so the old pools are dropped before the
    new ones are made and nothing is copied. With blocks held, each pool is copied, and K and V stay
    two allocations (the old K is freed before the new V exists)."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    layers, made = len(c.engine.k_cache), []
    pool = c.engine._pool
    monkeypatch.setattr(c.engine, "_pool", lambda shape: made.append(len(c.engine.k_cache) + len(c.engine.v_cache))
                        or pool(shape))
    c.prefill([0, 1], [40, 50])
    assert made == [0, layers]                      # no old pool alive when the new ones were made
    made.clear()
    c.prefill([2], [200])                           # #0 and #1 hold blocks: copied, then replaced
    assert made == [2 * layers, 2 * layers]
    assert c.engine.k_cache[0].untyped_storage().data_ptr() != c.engine.v_cache[0].untyped_storage().data_ptr()
    for _ in range(2):
        c.decode([0, 1, 2])


@pytest.mark.parametrize("held", [False, True])
def test_a_growth_that_runs_out_of_memory_leaves_the_engine_serving_cpu(tmp_path, monkeypatch, held):
    """A pool that cannot grow fails the call (torch.OutOfMemoryError, which a server catches to
    queue the requests again: serve/scheduler.py) and the engine goes on with the pool it had.
    With no block held the old pools had been dropped first and not made again: the next call that
    fitted them failed on an empty pool list (an IndexError, a 500 from the server), and on CUDA
    captured graphs still pointed at the freed pools. With blocks held, K may grow before V fails:
    it is cut back (the megakernel reads K and V with one stride)."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    pool, made = c.engine._pool, []

    def bounded(shape):
        made.append(shape[0])
        if shape[0] > 64 if not held else len(made) == 2:    # held: K grows, V does not
            raise torch.OutOfMemoryError("CUDA out of memory (a test's bound)")
        return pool(shape)
    if held:
        c.prefill([0], [20])
    monkeypatch.setattr(c.engine, "_pool", bounded)
    retired = c.engine._invalidate_graphs
    invalidated = []
    monkeypatch.setattr(c.engine, "_invalidate_graphs", lambda: invalidated.append(1) or retired())
    with pytest.raises(torch.OutOfMemoryError):
        c.engine.prefill([1], [c.tokens(200)])
    c.engine.remove([1])
    assert invalidated and len(c.engine.k_cache) == len(c.engine.v_cache) == TINY["num_hidden_layers"]
    assert c.engine.k_cache[0].shape == c.engine.v_cache[0].shape == (c.engine.blocks.num_blocks * 16, 4, 16)
    monkeypatch.setattr(c.engine, "_pool", pool)
    c.prefill([2], [10])                            # within the pool it had
    c.decode([2, 0] if held else [2])
    c.prefill([3], [90])                            # and it grows again where memory allows
    c.decode([3, 2])


def test_a_wide_first_call_grows_neither_the_table_nor_the_mailbox_cpu(tmp_path, monkeypatch):
    """A fresh engine's first call of 64 prompts of 22 blocks each (metadata of 4417 words) runs on the
    block table and eager mailbox create_engine made: a table growth drops every captured graph and a
    mailbox growth is a pinned allocation, both on the timed path (on an H100, part of 3.2 ms of GPU
    idle at the start of a 1B model's 64 x 512 prefill). The KV pool's growth is its one invalidation."""
    c = Checked(torch_plan(cache_tokens=1024, block_size=16), config(max_position_embeddings=512), tmp_path)
    box, rows = c.engine.eager_box, c.engine.block_table.shape[0]
    invalidated = []
    invalidate = c.engine._invalidate_graphs
    monkeypatch.setattr(c.engine, "_invalidate_graphs", lambda: invalidated.append(1) or invalidate())
    c.prefill(list(range(64)), [340] * 64)
    assert c.engine.eager_box is box and c.engine.block_table.shape[0] == rows
    assert len(invalidated) == 1
    c.decode(list(range(64)))


def test_a_call_past_the_eager_mailbox_grows_it_cpu(tmp_path):
    """A call whose metadata outgrows the eager mailbox gets a larger one (the first is sized so that
    wide calls do not need it: EAGER_MAILBOX_WORDS); prefill and decode still match the reference."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    module = sys.modules[type(c.engine).__module__]
    c.engine.eager_box = module.Mailbox(8, "cpu")
    c.prefill([0, 1, 2], [40, 7, 19])               # 3 x 3 + 1 + 3 x 6 words
    assert c.engine.eager_box.capacity >= module.prefill_metadata_size(3, 6)
    c.decode([2, 0, 1])


def test_many_requests_grow_the_row_table_cpu(tmp_path):
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    module = sys.modules[type(c.engine).__module__]
    ids = list(range(100, 100 + module.INITIAL_REQUEST_ROWS + 10))   # more rows than the table starts with
    c.prefill(ids, [1 + i % 5 for i in range(len(ids))])
    assert c.engine.block_table.shape[0] > module.INITIAL_REQUEST_ROWS
    c.decode(ids[::-1])
    c.remove(ids[:-10])
    c.decode(ids[-10:])


def test_remove_frees_blocks_cpu(tmp_path):
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    c.prefill([1, 2], [40, 20])
    free_before = c.engine.blocks.num_free()
    c.remove([1, 2, 3])
    assert c.engine.blocks.num_free() == free_before + 3 + 2
    assert not c.engine.requests


def test_decode_output_survives_the_next_call_cpu(tmp_path):
    c = Checked(torch_plan(), config(), tmp_path)
    c.prefill([0, 1], [3, 4])
    first = c.engine.decode([0, 1], c.tokens(2))
    kept = first.clone()
    c.engine.decode([0, 1], c.tokens(2))
    assert torch.equal(first, kept)


def with_fake_graphs(engine, module, max_batch=4, max_tokens=64):
    """Run the CUDA-graph code path on the CPU: 'capture' runs the step once into a static
    output and 'replay' reruns it on what the call posted to the graph's mailbox, so bucketing,
    padding, mailboxes, static outputs and recapture after growth are all exercised. A graph's
    step passes no prompts or tokens (on CUDA its kernel reads them through their addresses in
    the metadata): here the torch forms get the values at those addresses, looked up among the
    call's inputs, which checks the addresses. The attention slots get graph-safe stand-ins
    (they read the layout from cu_seqlens / context_lens, never from host lists)."""
    inputs = []   # the current call's prompts or tokens, as the engine reads them (after _input)

    def value_at(address):
        """The int64 element at `address` in one of the call's inputs."""
        for t in inputs:
            offset, rest = divmod(address - t.data_ptr(), t.element_size())
            if rest == 0 and 0 <= offset < t.numel():
                return t.view(-1)[offset]
        raise AssertionError(f"the metadata names address {address:#x}, in none of the call's inputs")

    def capture(key, box, padding, step):
        box.post(padding)
        engine.capturing = True
        logits = step()
        engine.capturing = False

        class Replay:
            def replay(self):
                logits.copy_(step())

        return module.CapturedStep(Replay(), box, padding, logits)

    def recording(kind, capture_step):
        def wrapped(size, *rest):
            engine.captured.append((kind, size))
            return capture_step(size, *rest)
        return wrapped

    def new_call(call):
        def wrapped(ids, given):
            inputs.clear()
            return call(ids, given)
        return wrapped

    def kept(as_input):
        def wrapped(t):
            inputs.append(as_input(t))
            return inputs[-1]
        return wrapped

    def words(box, start, stop):
        return box.words[module.MAILBOX_HEADER + start:module.MAILBOX_HEADER + stop].tolist()

    def prefill_inputs(block_table, box, num_tokens, num_seqs, num_writes, prompts=None):
        if prompts is None:
            prompts = []
            for address, start, end in zip(words(box, 2 * num_seqs + 1, 3 * num_seqs + 1), words(box, 0, num_seqs),
                                           words(box, 1, num_seqs + 1)):
                if address:
                    prompts.append(torch.stack([value_at(address + 8 * j) for j in range(end - start)]))
        return module.prefill_inputs_torch(block_table, box, num_tokens, num_seqs, num_writes, prompts)

    def decode_inputs(block_table, box, batch, width, token_ids=None):
        if token_ids is None:
            addresses = words(box, 5 * batch, 6 * batch)
            token_ids = torch.tensor([int(value_at(a)) for a in addresses if a], dtype=torch.long)
            assert addresses[len(token_ids):] == [0] * (batch - len(token_ids))   # padding rows last
        return module.decode_inputs_torch(block_table, box, batch, width, token_ids)

    def prefill_from_cu(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
        bounds = cu_seqlens.tolist()
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        return module.prefill_attention__torch(q, k, v, cu_seqlens, lens, max_seqlen, scale)

    def decode_full_width(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
        """Checks the bound the engine promises (every context <= max_context) at every replay."""
        if not engine.capturing:
            assert int(context_lens.max()) <= max_context
            engine.context_bounds.add(max_context)
        return module.decode_attention__torch(q, k_cache, v_cache, block_table, context_lens,
                                              block_table.shape[1] * block_size, block_size, scale)

    kernels = dataclasses.replace(engine.kernels, prefill_attention=prefill_from_cu,
                                  decode_attention=decode_full_width)
    engine.kernels = engine.model.kernels = kernels
    engine.captured = []
    engine.capturing = False
    engine.context_bounds = set()
    engine._capture = capture
    engine._capture_prefill = recording("prefill", engine._capture_prefill)
    engine._capture_decode = recording("decode", engine._capture_decode)
    engine.prefill = new_call(engine.prefill)
    engine.decode = new_call(engine.decode)
    engine._input = kept(engine._input)
    engine.prefill_inputs = prefill_inputs
    engine.decode_inputs = decode_inputs
    engine.decode_buckets = module.powers_of_two(1, max_batch)
    engine.prefill_buckets = module.powers_of_two(module.MIN_GRAPH_TOKENS, max_tokens)
    return engine


def test_graph_code_path_on_cpu(tmp_path):
    c = Checked(torch_plan(**SMALL_CACHE), config(num_key_value_heads=2, head_dim=24), tmp_path)
    module = sys.modules[type(c.engine).__module__]
    with_fake_graphs(c.engine, module)
    retired_during_passes = []   # graphs that growth invalidated are destroyed after the pass is queued
    for name in ("_prefill_step", "_decode_step"):
        def noting(*args, _step=getattr(c.engine, name)):
            retired_during_passes.append(len(c.engine.retired_graphs))
            return _step(*args)
        setattr(c.engine, name, noting)
    public_sequence(c)
    ragged_trace(c)                                  # pool growth invalidates and recaptures
    assert max(retired_during_passes) > 0 and not c.engine.retired_graphs
    c.prefill([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])   # 21 tokens: the 32 bucket, padded
    c.prefill(list(range(10, 28)), [1] * 18)         # more prompts than a captured prefill holds
    c.prefill([30], [65])                            # more tokens than the largest bucket
    c.decode([1, 30, 2, 3, 4])                       # batch 5: eager (largest bucket is 4)
    c.decode([6, 5, 30])                             # batch 3: the 4 bucket, padded
    c.decode([6, 5])                                 # short contexts: the short-context class
    c.prefill([40, 41], [5, 9], as_input=lambda t: t.to(torch.int32))     # converted before use
    c.decode([41, 40], as_input=lambda t: torch.stack([t, t], 1)[:, 0])   # strided: copied
    assert {("prefill", 32), ("decode", 4)} <= set(c.engine.captured)
    short = module.SHORT_CONTEXT
    assert {short, c.engine.max_positions} <= c.engine.context_bounds   # both classes replayed
    assert {key[1] for key in c.engine.decode_graphs} == {short, None}


def test_rope_inside_prefill_attention_cpu(tmp_path):
    """A prefill_attention variant that defines prefill_attention_rope_cache takes RoPE and the
    cache writes of the prefill passes above fused_rows: no rope_cache call there, the same
    outputs. (The Triton variant's kernel is checked by slot_check; here a torch composition
    stands in for it, to check the engine's wiring.) Plain weights: packed ones never take the
    fused path."""
    plan = torch_plan(fused_rows=8, **SMALL_CACHE)
    module = load_engine(plan)
    module.cpu_packing_works = lambda: False
    c = Checked(plan, config(num_key_value_heads=2, head_dim=24), tmp_path, module=module)
    calls = {"rope_cache": 0, "fused": 0}

    def rope_cache(*args):
        calls["rope_cache"] += 1
        return module.rope_cache__torch(*args)

    def fused(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache, cu_seqlens, seq_lens, max_seqlen, scale):
        calls["fused"] += 1
        module.rope_cache__torch(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache)
        return module.prefill_attention__torch(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale)

    kernels = dataclasses.replace(c.engine.kernels, rope_cache=rope_cache, prefill_attention_rope_cache=fused)
    c.engine.kernels = c.engine.model.kernels = kernels
    c.prefill([0, 1], [5, 30])                 # 35 tokens: above fused_rows, RoPE in the attention
    assert calls == {"rope_cache": 0, "fused": 2}   # one call per layer
    c.decode([0, 1])                           # a fused pass: RoPE in the QKV projection
    c.prefill([2], [3])
    ragged_trace(c)
    assert calls["rope_cache"] == 0


def test_decode_metadata_layout():
    """Four int64 rows, context_lens and blocks as the int32 halves of the fifth, the token
    addresses; padding rows are the scratch row's (address 0: token 0)."""
    module = load_engine(torch_plan())
    words = module.decode_metadata([5, 16], [37, 80], [3, 1], [0, 1], [6, 17], [2, 5], range(800, 816, 8), 3)
    meta = torch.tensor(words, dtype=torch.long).view(module.DECODE_META_ROWS, 3)
    assert meta[:4].tolist() == [[5, 16, 0], [37, 80, module.SCRATCH_SLOT], [3, 1, module.SCRATCH_ROW],
                                 [0, 1, 0]]
    context_lens, blocks = meta[4].view(torch.int32).view(2, -1)
    assert context_lens.tolist() == [6, 17, 1]
    assert blocks.tolist() == [2, 5, module.SCRATCH_BLOCK]
    assert meta[5].tolist() == [800, 808, 0]


def test_prefill_metadata_padding():
    module = load_engine(torch_plan())
    row, block = module.SCRATCH_ROW, module.SCRATCH_BLOCK
    meta = module.prefill_metadata([2, 1], [1, 2], [640, 768], ([1, 2], [0, 0], [7, 9]), 5, 4, 4)
    assert meta == ([0, 2, 3, 5, 5] + [1, 2, row, row] + [640, 768, 0, 0]
                    + [1, 2, row, row] + [0, 0, 0, 0] + [7, 9, block, block])
    assert module.padded_seq_lens([2, 1], 5, 4) == [2, 1, 2, 0]
    assert module.prefill_metadata([1], [3], [64], ([3], [0], [4]), 1, 1, 1) == [0, 1, 3, 64, 3, 0, 4]
    assert len(meta) == module.prefill_metadata_size(4, 4)


def test_prefill_layout_is_derived_on_the_device(tmp_path):
    """Tokens, positions and slots of a padded packed prefill, from the per-sequence metadata in
    a mailbox: two prompts (the second crossing a block boundary), then graph padding in the
    scratch row. Reading the mailbox acknowledges the post."""
    c = Checked(torch_plan(**SMALL_CACHE), config(), tmp_path)
    module = sys.modules[type(c.engine).__module__]
    bs = module.BLOCK_SIZE
    seq_lens = [2, bs + 1]
    prompts = [c.tokens(n) for n in seq_lens]
    writes = ([1, 2, 2], [0, 0, 1], [7, 9, 4])
    box = module.Mailbox(64, "cpu")
    box.post(module.prefill_metadata(seq_lens, [1, 2], [p.data_ptr() for p in prompts], writes, bs + 5, 4, 6))
    assert box.array[module.MAILBOX_ACKED] != box.array[module.MAILBOX_POSTED]
    tokens, cu, positions, slots, last = c.engine.prefill_inputs(c.engine.block_table, box, bs + 5, 4, 6, prompts)
    assert box.array[module.MAILBOX_ACKED] == box.array[module.MAILBOX_POSTED]
    assert tokens.tolist() == prompts[0].tolist() + prompts[1].tolist() + [0, 0]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, bs + 3, bs + 5, bs + 5]
    assert positions.tolist() == [0, 1] + list(range(bs + 1)) + [0, 0]
    assert slots.tolist() == ([7 * bs, 7 * bs + 1] + [9 * bs + j for j in range(bs)] + [4 * bs]
                              + [module.SCRATCH_SLOT] * 2)
    assert last.tolist() == [1, bs + 2, bs + 4, bs + 4]
    assert c.engine.block_table[2, :2].tolist() == [9, 4]


# ---- CUDA: fp16 and bf16, graphs on and off, torch and CUDA variants ----

def cuda_variant_plans():
    """The all-torch plan, one plan per CUDA variant on disk (other slots torch), and one with a
    CUDA variant of every slot that has one (Triton variants first)."""
    plans = {"torch": {s: "torch" for s in SLOTS}}
    combined = dict(plans["torch"])
    for slot, variants in menu().items():
        cuda = [v.name for v in variants if v.name != "torch" and "cuda" in v.devices]
        for name in cuda:
            plans[f"{slot}={name}"] = {**plans["torch"], slot: name}
        triton_first = sorted(cuda, key=lambda n: (not n.startswith("triton"), n))
        if triton_first:
            combined[slot] = triton_first[0]
    if combined != plans["torch"]:
        plans["all-cuda"] = combined
    return plans


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_PLANS = cuda_variant_plans()


@cuda_only
@pytest.mark.parametrize("slots", list(CUDA_PLANS.values()), ids=list(CUDA_PLANS))
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("cfg", [
    config(),
    config(torch_dtype="bfloat16", num_key_value_heads=1, head_dim=40),
    config(torch_dtype="bfloat16", num_key_value_heads=2, head_dim=24, num_attention_heads=8),
], ids=["fp16", "bf16-mqa", "bf16-gqa"])
def test_cuda(tmp_path, slots, graphs, cfg):
    plan = Plan("paged", slots=slots, params={**SMALL_CACHE, "decode_graphs": graphs, "max_graph_batch": 4,
                                              "prefill_graphs": graphs, "max_graph_tokens": 64})
    c = Checked(plan, cfg, tmp_path, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL,
                scale=GPU_SCALE[cfg["torch_dtype"]])
    public_sequence(c)
    ragged_trace(c)
    c.prefill([9, 10, 11, 12, 13, 14], [1100, 3, 64, 65, 2, 16])   # long prompt; batch above the graphs
    for _ in range(3):
        c.decode([14, 13, 12, 11, 10, 9])
        c.decode([9, 11])


@cuda_only
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("cfg", [config(), config(num_key_value_heads=2, head_dim=24, num_attention_heads=8)],
                         ids=["fp16", "fp16-gqa"])
@pytest.mark.parametrize("kernel_params", [{"fused_reduce": True}, {"pdl": False}],
                         ids=["fused_reduce", "no_pdl"])
def test_cuda_fused_reduce_and_pdl(tmp_path, graphs, cfg, kernel_params):
    """The linear and split decode kernels with fused_reduce (last-program reductions, with pdl as
    by default: every decode kernel launched early, GEMMs loading weights before their wait) or
    with pdl off (plain launches, what a GPU older than sm_90 or a Triton without gdc_wait runs,
    no longer the default that the other CUDA tests cover) through the engine's traces, captured
    graphs and eager passes both; decode batches of 6 and 2 rows."""
    slots = {**CUDA_PLANS.get("all-cuda", FUSED_REDUCE_SLOTS), **FUSED_REDUCE_SLOTS}
    plan = Plan("paged", slots=slots, params={**SMALL_CACHE, "decode_graphs": graphs, "max_graph_batch": 4,
                                              "prefill_graphs": graphs, "max_graph_tokens": 64,
                                              "decode_splits": 3, **kernel_params})
    c = Checked(plan, cfg, tmp_path, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL, scale=GPU_SCALE[cfg["torch_dtype"]])
    # The fused kernels themselves, not the torch variants a failed compile falls back to (probe_kernels).
    assert {s: c.engine.kernels.variants[s] for s in ("linear", "decode_attention")} == \
        {"linear": "triton", "decode_attention": "triton_split"}
    public_sequence(c)
    ragged_trace(c)
    c.prefill([9, 10, 11, 12, 13, 14], [1100, 3, 64, 65, 2, 16])
    for _ in range(3):
        c.decode([14, 13, 12, 11, 10, 9])
        c.decode([9, 11])


MEGA_CONFIGS = [config(), config(torch_dtype="bfloat16", num_key_value_heads=1, head_dim=40),
                config(torch_dtype="bfloat16", num_key_value_heads=2, head_dim=24, num_attention_heads=8)]


@cuda_only
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("cfg", MEGA_CONFIGS, ids=["fp16", "bf16-mqa", "bf16-gqa"])
def test_cuda_megakernel(tmp_path, graphs, cfg):
    """The decode megakernel (persistent, grid barriers) through the engine's traces against the
    reference: it passes create_engine's check, and in eager passes every step of at most
    MEGA_ROWS rows goes through it (under graphs it runs inside the captured steps)."""
    slots = {**CUDA_PLANS.get("all-cuda", FUSED_REDUCE_SLOTS)}
    plan = Plan("paged", slots=slots, params={**SMALL_CACHE, "decode_graphs": graphs, "max_graph_batch": 4,
                                              "prefill_graphs": graphs, "max_graph_tokens": 64, "megakernel": True})
    module = load_engine(plan)
    rows = []
    step = module.DecodeMegakernel.__call__

    def counted(self, tokens, *rest):
        rows.append(tokens.shape[0])
        return step(self, tokens, *rest)

    module.DecodeMegakernel.__call__ = counted
    c = Checked(plan, cfg, tmp_path, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL, scale=GPU_SCALE[cfg["torch_dtype"]],
                module=module)
    mega = c.engine.megakernel
    assert mega is not None, "the megakernel failed create_engine's check (see the warning)"
    # the check's step (and its grid fitting's), then one a captured step
    assert len(rows) >= 1 + len(c.engine.decode_buckets) * len(c.engine.context_classes), rows
    checked = len(rows)
    public_sequence(c)
    ragged_trace(c)
    c.prefill([9, 10, 11, 12, 13, 14], [1100, 3, 64, 65, 2, 16])   # long prompt: every split in use
    for _ in range(3):
        c.decode([14, 13, 12, 11, 10, 9])
        c.decode([9, 11])
    assert max(rows) <= module.MEGA_ROWS, rows
    assert graphs or len(rows) > checked, "eager decode steps did not run the megakernel"
    assert not mega.failed(), "a grid barrier timed out"


@cuda_only
def test_cuda_megakernel_persistent_gives_the_stepwise_bits(tmp_path):
    """The persistent kernel (one launch, grid barriers) against the same phases launched one by
    one (kernel boundaries as barriers): bit for bit, on steps whose contexts span several splits.
    A barrier that lets a program read before the others have written shows up here."""
    cfg = config(num_key_value_heads=2, head_dim=24, num_attention_heads=8)
    plan = Plan("paged", slots={**FUSED_REDUCE_SLOTS}, params={"decode_graphs": False, "prefill_graphs": False,
                                                               "megakernel": True})
    c = Checked(plan, cfg, tmp_path, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL, scale=GPU_SCALE["float16"])
    engine = c.engine
    persistent = engine.megakernel
    module = sys.modules[type(engine).__module__]
    stepwise = module.DecodeMegakernel(engine.model, engine.cfg, "cuda", persistent=False)
    ids = [3, 4, 5, 6]
    c.prefill(ids, [300, 1, 77, 160])
    for step in range(4):
        tokens = c.tokens(len(ids))
        engine.megakernel = persistent
        first = engine.decode(ids, tokens).clone()
        for rid in ids:
            engine.requests[rid].length -= 1          # the same step again, stepwise
        engine.megakernel = stepwise
        second = engine.decode(ids, tokens)
        assert torch.equal(first, second), f"step {step}: persistent and stepwise differ"
    assert not persistent.failed(), "a grid barrier timed out"


@cuda_only
@pytest.mark.parametrize("mega", [False, True], ids=["slots", "megakernel"])
def test_cuda_a_later_engine_of_the_module_captures_without_eager_steps(tmp_path, mega):
    """The judge builds many engines of one module in a process. The first runs each graph's step
    eagerly before capturing it (its kernels compile outside the capture); a later engine of the
    same model finds that step run (Engine._capture) and captures without it, and still matches
    the reference; an engine of another model, or one whose megakernel failed its check, runs its
    own eager steps."""
    slots = {**CUDA_PLANS.get("all-cuda", FUSED_REDUCE_SLOTS)}
    plan = Plan("paged", slots=slots, params={**SMALL_CACHE, "max_graph_batch": 4, "max_graph_tokens": 64,
                                              "megakernel": mega})
    module = load_engine(plan)
    eager = []   # one entry a step run outside a capture
    for name in ("_decode_step", "_prefill_step"):
        def counted(self, *args, _step=getattr(module.Engine, name), **kwargs):
            if not torch.cuda.is_current_stream_capturing():
                eager.append(name)
            return _step(self, *args, **kwargs)
        setattr(module.Engine, name, counted)

    def created(cfg, weight_dir, seed):
        eager.clear()
        c = Checked(plan, cfg, weight_dir, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL, seed=seed,
                    scale=GPU_SCALE[cfg["torch_dtype"]], module=module)
        return c, len(eager), len(c.engine.decode_graphs) + len(c.engine.prefill_graphs)

    first, first_eager, graphs = created(config(), tmp_path / "first", 0)
    assert graphs > 0 and first_eager >= graphs
    later, later_eager, _ = created(config(), tmp_path / "later", 1)
    assert later_eager == first_eager - graphs, "a later engine of the same model ran its steps eagerly again"
    public_sequence(later)
    ragged_trace(later)
    if mega:   # a later engine whose megakernel failed its check runs other kernels: its own eager steps
        checked = module.Engine._checked_megakernel
        module.Engine._checked_megakernel = lambda self: None
        without, without_eager, without_graphs = created(config(), tmp_path / "without", 3)
        module.Engine._checked_megakernel = checked
        assert without_eager >= without_graphs, "an engine without the megakernel skipped its eager steps"
        public_sequence(without)
    other, other_eager, other_graphs = created(config(num_key_value_heads=2, head_dim=24, num_attention_heads=8),
                                               tmp_path / "other", 2)
    assert other_eager >= other_graphs, "an engine of another model skipped its eager steps"
    public_sequence(other)


def test_the_megakernel_check_takes_a_right_step_and_refuses_a_wrong_one_cpu(tmp_path):
    """create_engine's check (Engine._checked_megakernel) on the CPU, with stand-ins for the kernel
    (the engine builds none there): one that computes the slots' pass passes and is kept; one that
    returns wrong hidden states, and one that fails to build, leave decode to the slots with a
    warning. Either way the check's random keys and values are cleared from the pool."""
    plan = torch_plan(megakernel=True)
    module = load_engine(plan)
    module.cpu_packing_works = lambda: False
    engine = Checked(plan, config(num_key_value_heads=2), tmp_path, module=module).engine
    assert engine.megakernel is None                # a CPU engine builds none

    class SlotsPass:
        """The step as the slots compute it (what a right kernel returns)."""
        def __init__(self, model, cfg, device):
            self.model = model

        def __call__(self, tokens, positions, slots, table, context_lens, k_cache, v_cache, rope, scale):
            def attend(layer, q, k, v):
                return engine.kernels.decode_attention(q, k_cache[layer], v_cache[layer], table, context_lens,
                                                       int(context_lens.max()), module.BLOCK_SIZE, scale)
            return self.model.hidden_states(tokens, positions, slots, rope, k_cache, v_cache, attend)

        def failed(self):
            return False

    class Wrong(SlotsPass):
        def __call__(self, *args):
            return super().__call__(*args) * 1.5

    class Unbuildable(SlotsPass):
        def __init__(self, *args):
            raise RuntimeError("no such kernel here")

    module.DecodeMegakernel = SlotsPass
    assert isinstance(engine._checked_megakernel(), SlotsPass)
    for stand_in, says in ((Wrong, "off the slots' pass"), (Unbuildable, "no such kernel here")):
        module.DecodeMegakernel = stand_in
        with pytest.warns(UserWarning, match=f"decode megakernel disabled.*{says}"):
            assert engine._checked_megakernel() is None
    assert not any(cache.any() for cache in (*engine.k_cache, *engine.v_cache))


def check_layout_kernels(module, device, trials=12):
    """prefill_inputs_triton and decode_inputs_triton against their torch forms on random packed
    prefills (graph padding and spare writes included) and decode steps (padding rows included),
    the metadata posted to a mailbox each time: the same outputs (tokens gathered through their
    addresses included), the same block table after, and every post acknowledged."""
    rng = random.Random()
    bs, scratch = module.BLOCK_SIZE, module.SCRATCH_ROW
    box = module.Mailbox(4096, device)

    def both(form_torch, form_triton, values, *args):
        """(torch form's outputs and table, Triton form's), each run on its own copy of the table."""
        out = []
        for form in (form_torch, form_triton):
            box.post(values)
            copy = table.clone()
            out.append((form(copy, box, *args), copy))
        if device == "cuda":
            torch.cuda.synchronize()
        assert box.array[module.MAILBOX_ACKED] == box.array[module.MAILBOX_POSTED], "post not acknowledged"
        return out

    for _ in range(trials):
        width = rng.choice([32, 700])   # 700: the row gather spans several column tiles
        table = torch.randint(1, 10_000, (64, width), dtype=torch.int32, device=device)
        table[scratch] = module.SCRATCH_BLOCK
        seq_lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 20))]
        prompts = [torch.randint(0, 1 << 40, (n,), device=device) for n in seq_lens]
        rows = rng.sample(range(scratch + 1, 64), len(seq_lens))
        blocks = iter(rng.sample(range(1, 10_000), sum(-(-n // bs) for n in seq_lens)))
        writes = ([], [], [])
        for row, n in zip(rows, seq_lens):
            for col in range(-(-n // bs)):
                writes[0].append(row)
                writes[1].append(col)
                writes[2].append(next(blocks))
        pad_tokens = rng.choice([0, 3, 37])
        num_seqs = len(seq_lens) + (pad_tokens > 0) + rng.randint(0, 3)
        num_tokens = sum(seq_lens) + pad_tokens
        num_writes = len(writes[0]) + rng.randint(0, 4)
        values = module.prefill_metadata(seq_lens, rows, [p.data_ptr() for p in prompts], writes, num_tokens,
                                         num_seqs, num_writes)
        (want, want_table), (got, got_table) = both(module.prefill_inputs_torch, module.prefill_inputs_triton,
                                                    values, num_tokens, num_seqs, num_writes, prompts)
        for name, w, g in zip(("tokens", "cu_seqlens", "positions", "slots", "last"), want, got):
            assert g.dtype == w.dtype and torch.equal(g, w), name
        assert torch.equal(got_table, want_table)

        batch = rng.randint(1, 64 - scratch - 1)
        live = rng.randint(1, batch)
        token_ids = torch.randint(0, 1 << 40, (live,), device=device)
        step_rows = rng.sample(range(scratch + 1, 64), live)
        cols = [rng.randrange(width) for _ in range(live)]
        new = [rng.randint(1, 10_000) for _ in range(live)]
        positions = [rng.randrange(1 << 20) for _ in range(live)]
        addresses = range(token_ids.data_ptr(), token_ids.data_ptr() + 8 * live, 8)
        values = module.decode_metadata(positions, positions, step_rows, cols, positions, new, addresses, batch)
        step_width = rng.randint(1, width)
        (want, want_table), (got, got_table) = both(module.decode_inputs_torch, module.decode_inputs_triton,
                                                    values, batch, step_width, token_ids)
        for name, w, g in zip(("meta", "table rows", "tokens"), want, got):
            assert g.dtype == w.dtype and torch.equal(g, w), name
        assert torch.equal(got_table, want_table)


@cuda_only
def test_layout_kernels_match_torch():
    check_layout_kernels(load_engine(torch_plan()), "cuda")


def _reductions():
    m = torch.backends.cuda.matmul
    return m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction


def _set_reductions(fp16, bf16) -> None:
    m = torch.backends.cuda.matmul
    m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = fp16, bf16


def test_fp32_reductions_hold_inside_the_engines_calls_and_the_callers_settings_come_back():
    """Issue 24: reduced-precision reductions off inside the engine's own calls only. create_engine
    used to switch them off for the whole process, the caller's reference included."""
    module = load_engine(torch_plan())
    before = module.reduction_settings()
    try:
        _set_reductions(True, False)
        with module.Fp32Reductions("cuda"):
            assert _reductions() == (False, False)
        assert _reductions() == (True, False)

        class Host:
            reductions = module.Fp32Reductions("cuda")

            @module.in_fp32_reductions
            def call(self, fail=False):
                if fail:
                    raise RuntimeError("the engine's call failed")
                return _reductions()
        assert Host().call() == (False, False) and _reductions() == (True, False)
        with pytest.raises(RuntimeError):
            Host().call(fail=True)
        assert _reductions() == (True, False)
        with module.Fp32Reductions("cpu"):   # a CPU engine leaves them alone
            assert _reductions() == (True, False)
        outer = module.Fp32Reductions("cuda")
        with outer:
            with outer:                        # nested: each puts back what it found
                assert _reductions() == (False, False)
            assert _reductions() == (False, False)
        assert _reductions() == (True, False)
        if isinstance(module.reduction_settings()[0], tuple):
            # this torch has the split-K flag too (a bool sets it True): (False, False) comes back as it was
            _set_reductions((False, False), True)
            with module.Fp32Reductions("cuda"):
                pass
            assert module.reduction_settings() == ((False, False), (True, True))
    finally:
        _set_reductions(*before)


@cuda_only
def test_a_cuda_engine_leaves_the_callers_reduction_settings_alone(tmp_path):
    before = _reductions()
    try:
        _set_reductions(True, True)
        plan = Plan("paged", slots=CUDA_PLANS.get("all-cuda", {}), params=SMALL_CACHE)
        c = Checked(plan, config(), tmp_path, device="cuda", atol=GPU_ATOL, rtol=GPU_RTOL, scale=GPU_SCALE["float16"])
        assert _reductions() == (True, True)
        public_sequence(c)
        assert _reductions() == (True, True)
    finally:
        _set_reductions(*before)
