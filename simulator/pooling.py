"""Pool the seeds of saved experiment results into one result with intervals (issue 13 item 2).

An experiment's JSON keeps every seed's value of every metric (``simulator.seeds``), so seeds run
apart -- on two machines, in two sessions, or added later to a published figure -- can be pooled
without simulating anything again:

    themis-sim pool fig16 --out docs/results/fig16 runs-a/fig16.json runs-b/fig16.json

Pooling walks the results side by side. Every interval (a dict with ``mean`` and ``values``) is
recomputed from the values of all the results, in the order the files are given; ``seeds`` and
``per_seed`` are joined. Everything else must be the same in every result -- the figure, the
points and their settings (knob values, lease, policy, cluster) -- or pooling stops and names the
field: pooling two different settings would publish a mean of nothing. A field that only some
results hold (a value every seed of one run shared, by chance, but not of another) is dropped. The
seeds must not overlap: the same seed twice would count one schedule twice (D16: a seed and the
code fix the outcome). What pooling cannot see is the code each part ran: parts from code that
schedules differently pool without complaint, so say which commit made each part (as
docs/results/README.md does) and check a shared point where there is one.

The pooled result is written as ``<figure>.json`` into ``--out`` with the figure's plots redrawn
from it. Figures whose plots need more than the saved aggregates (Figs. 9-11 draw per-app CDFs of
the first seed; Fig. 15 has its own strategic layout) are refused.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.seeds import interval

#: Figures whose saved JSON holds everything their plots need.
POOLABLE = ("fig12", "fig13", "fig14", "fig16")
_COUNTS = ("runs_reused", "runs_simulated")


class PoolError(ValueError):
    """Results that cannot be pooled, with the field that says why."""


def _is_interval(x: Any) -> bool:
    return isinstance(x, dict) and "mean" in x and isinstance(x.get("values"), list)


def _pool(parts: Sequence[Any], where: str) -> Any:
    first = parts[0]
    if _is_interval(first):
        if not all(_is_interval(p) for p in parts):
            raise PoolError(f"{where}: an interval in one result but not in another")
        values = [v for p in parts for v in p["values"]]
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise PoolError(f"{where}: a value that is not a number ({bad[0]!r})")
        pooled = interval(values)
        return {k: pooled[k] for k in first if k in pooled}  # a sweep's points keep no ci95
    if isinstance(first, dict):
        if not all(isinstance(p, dict) for p in parts):
            raise PoolError(f"{where}: a mapping in one result but not in another")
        out: dict[str, Any] = {}
        for key in sorted(set().union(*parts), key=lambda k: (k not in first, str(k))):
            here = f"{where}.{key}" if where else key
            holders = [i for i, p in enumerate(parts) if key in p]
            if len(holders) < len(parts):
                if any(isinstance(parts[i][key], (dict, list)) for i in holders):
                    # a policy, a point or a metric run in some results only: pooling would drop it
                    raise PoolError(f"{here}: only in result {', '.join(str(i + 1) for i in holders)} of "
                                    f"{len(parts)} (in the order given); only runs of the same settings pool")
                continue  # a value every seed of one run shared, by chance (see the module docstring)
            values = [p[key] for p in parts]
            if key in ("seeds", "per_seed"):
                out[key] = [x for v in values for x in v]
            elif key in _COUNTS:
                out[key] = sum(values)
            else:
                out[key] = _pool(values, here)
        return out
    if isinstance(first, list):
        if not all(isinstance(p, list) and len(p) == len(first) for p in parts):
            raise PoolError(f"{where}: lists of different lengths ({', '.join(str(len(p)) for p in parts)})")
        return [_pool([p[i] for p in parts], f"{where}[{i}]") for i in range(len(first))]
    if any(p != first for p in parts):
        raise PoolError(f"{where}: the results differ ({', '.join(repr(p) for p in parts)}); only runs of "
                        f"the same settings pool")
    return first


def pool_results(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result holding the seeds of all ``results`` (same figure, same settings, disjoint seeds)."""
    if len(results) < 2:
        raise PoolError("pooling needs at least two results")
    figures = {r.get("figure") for r in results}
    if len(figures) != 1:
        raise PoolError(f"figure: the results are of different figures ({', '.join(map(str, sorted(figures, key=str)))})")
    figure = figures.pop()
    if figure not in POOLABLE:
        raise PoolError(f"figure: {figure!r} cannot be pooled from its JSON; poolable: {', '.join(POOLABLE)}")
    seen: set[int] = set()
    for r in results:
        seeds = r.get("seeds")
        if not isinstance(seeds, list) or not seeds:
            raise PoolError("seeds: a result without its seeds")
        overlap = seen & set(seeds)
        if overlap:
            raise PoolError(f"seeds: seed {min(overlap)} is in two results; each seed may be pooled once")
        seen |= set(seeds)
    return _pool(results, "")


def replot(result: dict[str, Any], out: Path) -> None:
    """The figure's plots, drawn from a (pooled) result."""
    from simulator.experiments import fig14_plot, fig16_plots, sweep_plots

    n = len(result["seeds"])
    figure = result["figure"]
    if figure == "fig16":
        fig16_plots(out, [r["fairness_knob"] for r in result["fairness_knob"]], [r["lease_s"] for r in result["lease"]],
                    result["fairness_knob"], result["lease"], n)
    elif figure == "fig14":
        fig14_plot(out, result["points"], n)
    elif figure == "fig12":
        sweep_plots(out, result["contention"], result["policies"], xlabel="contention (x)", n_seeds=n,
                    figure=f"Fig. 12, {result['workload']} on {result.get('cluster', 'sim-256')}")
    elif figure == "fig13":
        sweep_plots(out, result["network_percent"], result["policies"], xlabel="network-intensive apps (%)",
                    figure="Fig. 13", n_seeds=n)
    else:
        raise PoolError(f"figure: {figure!r} cannot be pooled from its JSON; poolable: {', '.join(POOLABLE)}")


def pool_files(figure: str, paths: Sequence[Path], out: Path) -> dict[str, Any]:
    """Read the results, pool them, write ``out/<figure>.json`` and the plots; returns the result."""
    results = []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PoolError(f"{path}: not a readable result ({exc})") from exc
        if not isinstance(result, dict) or result.get("figure") != figure:
            found = result.get("figure") if isinstance(result, dict) else None
            raise PoolError(f"{path}: a result of {found!r}, not {figure!r}")
        results.append(result)
    pooled = pool_results(results)
    out.mkdir(parents=True, exist_ok=True)
    replot(pooled, out)
    (out / f"{figure}.json").write_text(json.dumps(pooled, indent=1))
    return pooled
