"""Where a decode step of the megakernel goes: the whole step under its settings, and each phase alone.

    python3 -m scripts.gpu megakernel-probe [--batch 8] [--context 160] [--iters 50]
        [--variants '{"name": {"MEGA_BLOCK_K": 256, "prefetch": false, ...}, ...}'] [--out DIR]

Why (issue 24): the first benchmark of the `megakernel` plan param read slower than the slots'
decode step. This builds one engine of the public config (`lib split linear` + megakernel,
graphs off), prefills `batch` prompts of `context` tokens, records the megakernel's inputs of
one decode step, and replays that step from CUDA graphs:
  slots       the same step through the slots' pass (Model.hidden_states: what the engine runs
              without the megakernel), for scale;
  <variant>   the persistent megakernel with module constants (MEGA_*) or `prefetch` changed (its
              grid fitted again: MEGA_PROGRAMS_PER_SM);
  phase p     phase p as a launch of its own (stepwise), every layer's in one graph (phase 0, the
              embeddings, once), per launch: which phase costs what, kernel boundaries included (a
              few us each; a graph of one launch, phase 0's, also carries the replay's own cost).
Each row is the median of --iters graph replays timed with CUDA events. Writes megakernel_probe.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from agent.plan import Plan
from evaluator.common import load_config, load_engine_module
from scripts.gpu.common import (FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans,
                                out_dir, render_to_file)
from scripts.gpu.persistent_probe import graph_us

DEFAULT_VARIANTS = {"as rendered": {}, "no prefetch": {"prefetch": False}, "block_k 256": {"MEGA_BLOCK_K": 256},
                    "8 warps": {"MEGA_WARPS": 8}}


def recorded_step(engine, batch: int, context: int):
    """The megakernel's arguments for one decode step of `batch` requests at `context` tokens."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = list(range(batch))
    engine.prefill(ids, [torch.randint(0, engine.cfg.vocab, (context,), generator=gen, device="cuda") for _ in ids])
    seen = []
    mega = engine.megakernel

    def record(*args):
        seen.append(args)
        return mega(*args)

    engine.megakernel = record
    engine.decode(ids, torch.randint(0, engine.cfg.vocab, (batch,), generator=gen, device="cuda"))
    engine.megakernel = mega
    return seen[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS))
    p.add_argument("--out", default=out_dir("/tmp/megakernel_probe"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = library_plans()[FINAL_PLAN]
    plan = Plan(base.engine, base.slots, {**base.params, "megakernel": True, "decode_graphs": False,
                                          "prefill_graphs": False})
    module = load_engine_module(str(render_to_file(plan, "megakernel-probe")))
    ensure_toy_weights()
    engine = module.create_engine(load_config(PUBLIC_CONFIG), PUBLIC_WEIGHTS, "cuda")
    assert engine.megakernel is not None, "the megakernel failed create_engine's check"
    args = recorded_step(engine, a.batch, a.context)
    tokens, positions, slots, table, context_lens, k_cache, v_cache, rope, scale = args
    rows = {}

    def attend(layer, q, k, v):
        return engine.kernels.decode_attention(q, k_cache[layer], v_cache[layer], table, context_lens,
                                               a.context + 1, module.BLOCK_SIZE, scale)

    with engine.reductions:
        rows["slots"] = graph_us(lambda: engine.model.hidden_states(tokens, positions, slots, rope, k_cache, v_cache,
                                                                    attend), a.iters)
        want = engine.model.hidden_states(tokens, positions, slots, rope, k_cache, v_cache, attend).float()
        mega = engine.megakernel
        errors, grids = {}, {}
        def owner(setting: str):
            """Where a variant's setting lives: MEGA_* constants in the module, the rest on the kernel."""
            return module if setting.startswith("MEGA_") else mega

        for name, change in json.loads(a.variants).items():
            saved = {k: getattr(owner(k), k) for k in change}
            for k, v in change.items():
                setattr(owner(k), k, v)
            refit(mega)
            rows[name] = graph_us(lambda: mega(*args), a.iters)
            grids[name] = mega.programs
            errors[name] = ((mega(*args).float() - want).abs().max() / want.abs().max()).item()
            for k, v in saved.items():
                setattr(owner(k), k, v)
        refit(mega)
        mega(*args)
        step, tail, meta = mega.launch_arguments(*args)
        for phase in range(module.MEGA_PHASES + 1):
            layers = [0] if phase == 0 else list(range(engine.cfg.layers))    # phase 0 runs once a step

            def launch(phase=phase, layers=layers):
                for layer in layers:
                    module._mk_decode_kernel[(mega.programs,)](*step, layer, *tail, **{**meta, "PERSISTENT": False,
                                                                                         "PHASE": phase,
                                                                                         "PREFETCH": False})
            rows[f"phase {phase} (a launch)"] = graph_us(launch, a.iters) / len(layers)
    result = {"device": torch.cuda.get_device_name(0), "batch": a.batch, "context": a.context,
              "programs": grids, "us": rows, "rel_err_vs_slots": errors}
    (out / "megakernel_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}, batch {a.batch}, context {a.context}")
    for name, us in rows.items():
        print(f"  {name:24} {us:8.1f} us" + (f"   ({grids[name]} programs, rel err vs slots {errors[name]:.1e})"
                                             if name in errors else ""))


def refit(mega) -> None:
    """Have the next call fit the grid again (to changed constants)."""
    mega.fitted = False
    mega.programs = mega.device_props.multi_processor_count
