"""What the benchmarks bid on: fragmented free GPU sets and the models' slowdowns."""

from __future__ import annotations

import random

from agent.placement import Slowdown, load_profiles
from arbiter.cluster import Cluster

PROFILE_SOURCE = "agent/profiles/slowdowns.toml"


def slowdown_models() -> list[Slowdown]:
    """The slowdown tuple of every model in the shipped profile table, in name order."""
    profiles = load_profiles()
    return [profiles[name].slowdown for name in sorted(profiles)]


def fragmented_free(cluster: Cluster, n_free: int, rng: random.Random) -> frozenset[str]:
    """``n_free`` free GPUs, machine by machine in random order, most of each machine free."""
    machines = list(cluster.machines.values())
    rng.shuffle(machines)
    free: list[str] = []
    for gpus in machines:
        if len(free) == n_free:
            break
        share = rng.uniform(0.6, 1.0)
        free.extend(rng.sample(gpus, min(n_free - len(free), max(1, round(share * len(gpus))))))
    taken = set(free)
    rest = [g for g in cluster.gpu_ids if g not in taken]
    free.extend(rng.sample(rest, n_free - len(free)))  # only when nearly all of the cluster is free
    return frozenset(free)
