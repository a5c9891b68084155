"""The arbiter's cluster file from a Slurm cluster's own description (issue 6).

``themis-arbiter cluster-from-slurm`` reads ``scontrol --oneliner show nodes`` and writes a cluster
file whose machines are named like the Slurm nodes, so a lease's GPU ``n3-g1`` is GPU index 1 of node
``n3`` and the ``slurm`` executor can pin a job to it (``agent.executors.slurm``). A node counts
only with its GPUs declared one GRES type per index (``Gres=gpu:g0:1,gpu:g1:1,...``): with a plain
count (``gpu:4``) Slurm, not the lease, would choose the indices. Such nodes are left out, and the
file says which and why. All nodes go into one rack: Slurm has no racks of its own (its
``topology.conf`` switches could be mapped, but nothing reads them yet); edit the file to split them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SlurmNode", "cluster_toml", "parse_nodes", "unavailable"]

#: Slurm node state words after which a node takes no new jobs (``DRAIN``, ``DRAINING``, ``DRAINED``,
#: ``DOWN``, ``FAIL``, ``FAILING``, ``NOT_RESPONDING`` shown as ``*``, ``MAINT``, ``REBOOT``, ...).
_UNAVAILABLE = ("DRAIN", "DOWN", "FAIL", "MAINT", "REBOOT", "POWER", "INVAL", "NOT_RESPONDING")

_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class SlurmNode:
    name: str
    gpu_indices: tuple[int, ...]  # from per-index GRES types
    state: str
    problem: str = ""  # why the node cannot be used ("" if it can)


def parse_nodes(text: str, gres_type: str = "g{index}") -> list[SlurmNode]:
    """Nodes from ``scontrol --oneliner show nodes`` (one node per line). ValueError for a
    ``gres_type`` without ``{index}``."""
    if "{index}" not in gres_type:
        raise ValueError(f"the GRES type pattern must contain '{{index}}', got {gres_type!r}")
    type_re = re.compile("^" + re.escape(gres_type).replace(re.escape("{index}"), r"(\d+)") + "$")
    nodes = []
    for line in text.splitlines():
        fields = dict(_FIELD.findall(line))
        name = fields.get("NodeName")
        if not name:
            continue
        indices: list[int] = []
        problem = ""
        for item in filter(None, re.sub(r"\([^)]*\)", "", fields.get("Gres", "")).split(",")):
            parts = item.split(":")
            if parts[0] != "gpu":
                continue
            if len(parts) == 3 and (m := type_re.match(parts[1])) and parts[2] == "1":
                indices.append(int(m.group(1)))
            else:
                problem = (f"GRES {item!r} is not one type per GPU index ({gres_request_hint(gres_type)}), "
                           "so a lease could not pin its GPUs")
        if not indices and not problem:
            problem = "no GPUs"
        if len(set(indices)) != len(indices):
            problem = f"GPU index repeated in {fields.get('Gres')!r}"
        nodes.append(SlurmNode(name, tuple(sorted(indices)), fields.get("State", "?"), problem))
    return nodes


def unavailable(nodes: Iterable[SlurmNode]) -> list[str]:
    """Nodes Slurm would not start new jobs on: the arbiter should not grant their GPUs either."""
    return [n.name for n in nodes if any(word in n.state.upper() for word in _UNAVAILABLE) or n.state.endswith("*")]


def gres_request_hint(gres_type: str) -> str:
    return ",".join(f"gpu:{gres_type.format(index=i)}:1" for i in range(2)) + ",..."


def cluster_toml(nodes: Iterable[SlurmNode], name: str, rack: str = "r0") -> str:
    """A cluster file (``arbiter.cluster`` format) with one machine per usable node."""
    nodes = list(nodes)
    usable = [n for n in nodes if not n.problem]
    lines = ["# Generated from `scontrol show nodes` by themis-arbiter cluster-from-slurm.",
             f"name = {_quote(name)}"]
    for node in nodes:
        if node.problem:
            lines.insert(1, f"# left out: {node.name}: {node.problem}")
        elif node.gpu_indices != tuple(range(len(node.gpu_indices))):
            lines.insert(1, f"# left out: {node.name}: GPU indices {list(node.gpu_indices)} are not 0..n-1")
    usable = [n for n in usable if n.gpu_indices == tuple(range(len(n.gpu_indices)))]
    if not usable:
        raise ValueError("no Slurm node has its GPUs declared one GRES type per index; see docs/executors.md")
    lines += ["", "[[racks]]", f"name = {_quote(rack)}"]
    groups: list[tuple[int, list[str]]] = []
    for node in usable:
        if groups and groups[-1][0] == len(node.gpu_indices):
            groups[-1][1].append(node.name)
        else:
            groups.append((len(node.gpu_indices), [node.name]))
    for gpus, names in groups:
        lines += ["[[racks.machines]]", f"gpus = {gpus}", f"names = [{', '.join(map(_quote, names))}]"]
    return "\n".join(lines) + "\n"


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
