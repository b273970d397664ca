"""A miner of another kind for ``dtrain sandbox --adversary KIND``, outside ``dtrain mine``.

``python -m dtrain.cli.sandbox_neuron KIND --config PATH [--max-rounds N]`` runs the sandbox's
miner of that kind (dtrain/sandbox/adversary.py: a cheat, or an honest miner on other hardware)
exactly as ``dtrain mine --config PATH --no-dashboard`` runs the honest one. It is no
subcommand of ``dtrain``: the miner an operator runs never carries a cheat's code path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dtrain.cli.common import CommandError, err, load
from dtrain.config import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.cli.sandbox_neuron",
                                     description="Run one of dtrain sandbox's miners of another kind.")
    parser.add_argument("kind", help="the kind (dtrain.sandbox.adversary.KINDS)")
    parser.add_argument("--config", required=True, type=Path, help="the neuron's config.toml")
    parser.add_argument("--max-rounds", type=int, default=None, help="stop after this many rounds")
    args = parser.parse_args(argv)
    from dtrain.cli.app import quiet_libraries
    from dtrain.sandbox.adversary import KINDS, miner_class

    quiet_libraries()  # as `dtrain mine` does

    if args.kind not in KINDS:
        parser.error(f"unknown kind {args.kind!r}; expected one of {', '.join(KINDS)}")
    try:
        cfg = load(args.config)
        from dtrain.cli.neuron_runner import run_neuron

        def build(telemetry, stop):
            return miner_class(args.kind)(cfg, telemetry, stop, max_rounds=args.max_rounds)

        return run_neuron(cfg, "miner", True, build)
    except ConfigError as exc:
        err(f"dtrain: config error: {exc}")
        return 2
    except CommandError as exc:
        err(f"dtrain: error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
