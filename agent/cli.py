"""``themis-agent``: what an app would bid.

    themis-agent rho-table APP.toml --gpus 1,2,4,8,16 [--level machine]

prints JSON {"<gpus>": rho, ...}: the app's finish-time fairness (Eq. 1/2, D2-D4) if it held that
many GPUs from now until it finishes, placed at the given locality level (D1).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from agent.app_config import AppConfigError, load_app
from agent.fairness import finish_time_fairness
from agent.placement import Position

LEVELS = {"slot": 0, "machine": 1, "rack": 2, "cluster": 3}


def placed(n: int, level: int) -> list[Position]:
    """n GPUs that span exactly ``level`` (one slot; slots of one machine; machines of one rack;
    racks), so S(G) is the profile's value at that level."""
    if level == 0:
        return [("r0", "m0", "s0")] * n
    if level == 1:
        return [("r0", "m0", f"s{k}") for k in range(n)]
    if level == 2:
        return [("r0", f"m{k}", "s0") for k in range(n)]
    return [(f"r{k}", f"m{k}", "s0") for k in range(n)]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants a comma-separated list of integers, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError("--gpus wants non-negative GPU counts")
    return counts


def _json_number(x: float) -> float | str:
    return "Infinity" if math.isinf(x) else round(x, 10)


def rho_table(args: argparse.Namespace) -> int:
    try:
        app, ctx = load_app(args.app)
    except AppConfigError as exc:
        print(f"themis-agent: {exc}", file=sys.stderr)
        return 2
    level = LEVELS[args.level]
    table = {
        str(n): _json_number(
            finish_time_fairness(
                app, placed(n, level), now=ctx.now, n_avg=ctx.n_avg, cluster_size=ctx.cluster_size
            )
        )
        for n in args.gpus
    }
    print(json.dumps(table))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="themis-agent", description="Themis agent tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("rho-table", help="print an app's rho for given GPU counts, as JSON")
    p.add_argument("app", help="app description (TOML), e.g. examples/paper_4_3_3.toml")
    p.add_argument("--gpus", type=_counts, required=True, help="comma-separated GPU counts, e.g. 1,2,4,8,16")
    p.add_argument("--level", choices=list(LEVELS), default="machine",
                   help="locality of the GPUs (D1); default: one machine")
    p.set_defaults(func=rho_table)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
