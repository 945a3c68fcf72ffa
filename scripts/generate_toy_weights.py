"""Write toy weights for a model config: float32, bare key names, untied lm_head (SPEC.md §1).

    python3 scripts/generate_toy_weights.py --config target/model_config.json \
        --output target/weights/model.pt [--seed 0] [--scale 0.02] [--norm-spread 0]

Every matrix is `randn * scale`, every norm weight one (or uniform in 1 ± norm-spread);
the same arguments always give the same file. Weights are generated, never committed. A
config the agent would refuse (agent/spec.py) gets one `error:` line and exit 1, no file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.spec import SpecError, read_config, spec_from_config  # noqa: E402
from evaluator.weights import DEFAULT_SEED, TOY_SCALE, random_weights, save_weights  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="model_config.json")
    p.add_argument("--output", required=True, help="path of the model.pt to write")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--scale", type=float, default=TOY_SCALE, help="std of every matrix")
    p.add_argument("--norm-spread", type=float, default=0.0,
                   help="norm weights uniform in 1 ± this (0: all ones, the toy init)")
    a = p.parse_args(argv)
    try:   # the agent's own checks: no weights for a config the agent would refuse
        config = read_config(Path(a.config))
        spec_from_config(config, Path(a.config), Path(a.output).parent)
    except SpecError as e:
        sys.exit(f"error: {e}")
    if Path(a.output).is_dir():
        sys.exit(f"error: --output {a.output} is a folder; name the file to write, e.g. {Path(a.output) / 'model.pt'}")
    weights = random_weights(config, a.seed, a.scale, a.norm_spread)
    out = save_weights(weights, a.output)
    params = sum(t.numel() for t in weights.values())
    print(f"wrote {out}: {len(weights)} tensors, {params / 1e6:.2f}M parameters (seed {a.seed}, scale {a.scale})")


if __name__ == "__main__":
    main()
