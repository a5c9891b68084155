"""Racks, machines, slots and GPUs; the locality level of a GPU set (mechanism D1).

A cluster is loaded from a TOML file (see ``arbiter/clusters/*.toml``)::

    name = "example"
    [[racks]]
    name = "r0"                      # optional, default r<index>
    [[racks.machines]]
    gpus = 8                         # GPUs per machine
    slots = 4                        # GPUs are split evenly over slots (default: one slot per GPU)
    count = 4                        # how many such machines (default 1)
    [[racks.machines]]
    gpus = 4
    names = ["n1", "n2"]             # machines named as the cluster engine knows them (Slurm nodes)

GPU ids are stable and readable: ``<rack>-m<machine>-g<index>``, machines numbered across the whole
cluster in file order (the same naming as ``shared/data/auction-instances``); a named machine's GPUs
are ``<name>-g<index>``, so an executor can tell the node and the index from the lease (issue 6;
``themis-arbiter cluster-from-slurm`` writes such a file from ``scontrol show nodes``). Every error
names the file and the key (or line, for TOML syntax) that is wrong.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

SLOT, MACHINE, RACK, CLUSTER = 0, 1, 2, 3
LEVEL_NAMES = {SLOT: "slot", MACHINE: "machine", RACK: "rack", CLUSTER: "cluster"}


MACHINE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ClusterFileError(ValueError):
    """A cluster file that cannot be used; the message names the file and the key or line."""


@dataclass(frozen=True, slots=True)
class Gpu:
    id: str
    slot: str
    machine: str
    rack: str
    index: int  # index within its machine


@dataclass(frozen=True)
class Cluster:
    """The static shape of a GPU cluster. Which GPUs are free is the lease table's business."""

    name: str
    gpus: Mapping[str, Gpu]
    description: str = ""
    _order: tuple[str, ...] = field(default=(), repr=False)

    @property
    def size(self) -> int:
        """R_C in the paper's Eq. 1."""
        return len(self.gpus)

    @cached_property
    def gpu_ids(self) -> tuple[str, ...]:
        return self._order or tuple(self.gpus)

    @cached_property
    def machines(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for gid in self.gpu_ids:
            out.setdefault(self.gpus[gid].machine, []).append(gid)
        return {m: tuple(g) for m, g in out.items()}

    @cached_property
    def racks(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {}
        for m, gids in self.machines.items():
            out.setdefault(self.gpus[gids[0]].rack, []).append(m)
        return {r: tuple(ms) for r, ms in out.items()}

    def locality(self, gpu_ids: Iterable[str]) -> int:
        """D1: 0 one slot (or one GPU), 1 one machine, 2 one rack, 3 across racks."""
        return locality_level([self.gpus[g] for g in gpu_ids])

    def position(self, gpu_id: str) -> tuple[str, str, str]:
        """(rack, machine, slot) of a GPU: the hierarchy that offers carry and bids read."""
        g = self.gpus[gpu_id]
        return (g.rack, g.machine, g.slot)

    def with_machine(self, rack: str, gpus: int, slots: int = 1) -> tuple[Cluster, str]:
        """The cluster plus one machine of ``gpus`` GPUs split evenly over ``slots`` slots in
        ``rack`` (a new rack if it has none yet), named like the file's machines; returns the new
        cluster and the machine's name. The arbiter grows a running cluster with this."""
        if not isinstance(rack, str) or not rack or "-" in rack or "/" in rack:
            raise ValueError(f"rack name must be a non-empty string without '-' or '/', got {rack!r}")
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise ValueError(f"a machine needs a positive number of GPUs, got {gpus!r}")
        slots = slots or 1
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1 or gpus % slots:
            raise ValueError(f"{gpus} GPUs cannot be split evenly over {slots!r} slots")
        numbers = [int(m.rsplit("-m", 1)[1]) for m in self.machines if m.rsplit("-m", 1)[-1].isdigit()]
        number = max(numbers, default=-1) + 1
        while f"{rack}-m{number}" in self.machines:
            number += 1
        machine = f"{rack}-m{number}"
        per_slot = gpus // slots
        added = {f"{machine}-g{k}": Gpu(f"{machine}-g{k}", f"{machine}-s{k // per_slot}", machine, rack, k)
                 for k in range(gpus)}
        order = (*self.gpu_ids, *added)
        return Cluster(self.name, {**self.gpus, **added}, self.description, order), machine

    def subcluster(self, machines: Iterable[str], name: str | None = None) -> "Cluster":
        """The same cluster with only the given machines (for contention experiments)."""
        keep = set(machines)
        order = tuple(g for g in self.gpu_ids if self.gpus[g].machine in keep)
        return Cluster(name or f"{self.name}-sub", {g: self.gpus[g] for g in order}, self.description, order)


def locality_level(gpus: Iterable[Gpu]) -> int:
    gpus = list(gpus)
    if len({g.slot for g in gpus}) <= 1:
        return SLOT
    if len({g.machine for g in gpus}) == 1:
        return MACHINE
    if len({g.rack for g in gpus}) == 1:
        return RACK
    return CLUSTER


def _positive_int(value: object, where: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterFileError(f"{path}: {where} must be a positive integer, got {value!r}")
    return value


def cluster_from_mapping(data: Mapping, path: str = "<cluster>") -> Cluster:
    """Build a cluster from parsed TOML; ``path`` only names the source in error messages."""
    known_top = {"name", "description", "racks"}
    for key in data:
        if key not in known_top:
            raise ClusterFileError(f"{path}: unknown key {key!r} (expected one of {sorted(known_top)})")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ClusterFileError(f"{path}: key 'name' must be a non-empty string")
    racks = data.get("racks")
    if not isinstance(racks, list) or not racks:
        raise ClusterFileError(f"{path}: key 'racks' must be a non-empty array of tables ([[racks]])")
    gpus: dict[str, Gpu] = {}
    order: list[str] = []
    rack_names: set[str] = set()
    machine_no = 0
    used_names: set[str] = set()
    for ri, rack in enumerate(racks):
        where = f"racks[{ri}]"
        if not isinstance(rack, Mapping):
            raise ClusterFileError(f"{path}: {where} must be a table")
        for key in rack:
            if key not in {"name", "machines"}:
                raise ClusterFileError(f"{path}: {where}: unknown key {key!r}")
        rname = rack.get("name", f"r{ri}")
        if not isinstance(rname, str) or not rname or "-" in rname:
            raise ClusterFileError(f"{path}: {where}.name must be a non-empty string without '-'")
        if rname in rack_names:
            raise ClusterFileError(f"{path}: {where}.name {rname!r} is used twice")
        rack_names.add(rname)
        machines = rack.get("machines")
        if not isinstance(machines, list) or not machines:
            raise ClusterFileError(f"{path}: {where}.machines must be a non-empty array of tables")
        for mi, spec in enumerate(machines):
            mwhere = f"{where}.machines[{mi}]"
            if not isinstance(spec, Mapping):
                raise ClusterFileError(f"{path}: {mwhere} must be a table")
            for key in spec:
                if key not in {"gpus", "slots", "count", "names"}:
                    raise ClusterFileError(f"{path}: {mwhere}: unknown key {key!r}")
            if "gpus" not in spec:
                raise ClusterFileError(f"{path}: {mwhere}: missing key 'gpus'")
            n_gpus = _positive_int(spec["gpus"], f"{mwhere}.gpus", path)
            n_slots = _positive_int(spec.get("slots", n_gpus), f"{mwhere}.slots", path)
            names = spec.get("names")
            if names is not None:
                if not isinstance(names, list) or not names or not all(
                        isinstance(n, str) and MACHINE_NAME.match(n) for n in names):
                    raise ClusterFileError(f"{path}: {mwhere}.names must be a non-empty list of machine names "
                                           "(letters, digits, '.', '_', '-'; starting with a letter or digit)")
                for n in names:
                    if n in used_names:
                        raise ClusterFileError(f"{path}: {mwhere}.names: machine {n!r} is named twice")
                    used_names.add(n)
                if "count" in spec and spec["count"] != len(names):
                    raise ClusterFileError(f"{path}: {mwhere}: count {spec['count']!r} but {len(names)} names")
            count = len(names) if names is not None else _positive_int(spec.get("count", 1), f"{mwhere}.count", path)
            if n_gpus % n_slots:
                raise ClusterFileError(
                    f"{path}: {mwhere}: {n_gpus} gpus cannot be split evenly over {n_slots} slots"
                )
            per_slot = n_gpus // n_slots
            for k in range(count):
                machine = names[k] if names is not None else f"{rname}-m{machine_no}"
                machine_no += 1
                if names is None and machine in used_names:
                    raise ClusterFileError(f"{path}: {mwhere}: machine {machine!r} is also a name given in the file")
                used_names.add(machine)
                for k in range(n_gpus):
                    gid = f"{machine}-g{k}"
                    gpus[gid] = Gpu(gid, f"{machine}-s{k // per_slot}", machine, rname, k)
                    order.append(gid)
    description = data.get("description", "")
    if not isinstance(description, str):
        raise ClusterFileError(f"{path}: key 'description' must be a string")
    return Cluster(name, gpus, description, tuple(order))


def load_cluster(name_or_path: str | Path) -> Cluster:
    """Load a shipped cluster by name (``testbed-64``, ``sim-256``) or any TOML file by path."""
    text: str
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ClusterFileError(f"{path}: cannot read cluster file: {exc.strerror}") from None
        label = str(path)
    else:
        shipped = resources.files("arbiter") / "clusters" / f"{name_or_path}.toml"
        if not shipped.is_file():
            raise ClusterFileError(
                f"unknown cluster {str(name_or_path)!r}: not a file, and not one of {shipped_clusters()}"
            )
        text = shipped.read_text()
        label = f"arbiter/clusters/{name_or_path}.toml"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ClusterFileError(f"{label}: invalid TOML: {exc}") from None
    return cluster_from_mapping(data, label)


def shipped_clusters() -> list[str]:
    folder = resources.files("arbiter") / "clusters"
    return sorted(p.name[: -len(".toml")] for p in folder.iterdir() if p.name.endswith(".toml"))
