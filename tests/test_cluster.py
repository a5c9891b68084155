"""Clusters from TOML: the shipped ones, locality levels (D1), and errors that say where."""

from __future__ import annotations

from collections import Counter

import pytest

from arbiter.cluster import ClusterFileError, load_cluster, shipped_clusters


def test_testbed_64_is_the_papers_testbed():
    c = load_cluster("testbed-64")
    assert c.size == 64
    sizes = Counter(len(g) for g in c.machines.values())
    assert sizes == {2: 8, 4: 12}
    assert len(c.racks) == 2


def test_sim_256_matches_the_yardstick_cluster():
    c = load_cluster("sim-256")
    assert c.size == 256
    assert Counter(len(g) for g in c.machines.values()) == {8: 24, 4: 12, 1: 16}
    # 8-GPU machines have 4 slots of 2, 4-GPU machines 4 slots of 1
    slots = {m: Counter(c.gpus[g].slot for g in gids) for m, gids in c.machines.items()}
    assert all(sorted(s.values()) == [2, 2, 2, 2] for m, s in slots.items() if len(c.machines[m]) == 8)
    assert all(sorted(s.values()) == [1, 1, 1, 1] for m, s in slots.items() if len(c.machines[m]) == 4)
    assert "r9-m40-g0" in c.gpus and "r0-m1-g7" in c.gpus
    assert shipped_clusters() == ["deepshare-4x8", "sim-256", "testbed-64"]


def test_gpu_ids_are_stable_across_loads():
    assert load_cluster("sim-256").gpu_ids == load_cluster("sim-256").gpu_ids


def test_locality_levels_d1():
    c = load_cluster("sim-256")
    assert c.locality(["r0-m0-g0"]) == 0
    assert c.locality(["r0-m0-g0", "r0-m0-g1"]) == 0  # one slot of 2
    assert c.locality(["r0-m0-g0", "r0-m0-g2"]) == 1  # two slots, one machine
    assert c.locality(["r0-m0-g0", "r0-m1-g0"]) == 2  # one rack
    assert c.locality(["r0-m0-g0", "r1-m4-g0"]) == 3  # across racks


def test_subcluster_keeps_only_given_machines():
    c = load_cluster("testbed-64")
    small = c.subcluster(list(c.machines)[:3])
    assert small.size == sum(len(c.machines[m]) for m in list(c.machines)[:3])


@pytest.mark.parametrize(
    "text, message",
    [
        ("name = 'x'\nthis is not toml\n", "invalid TOML.*line 2"),
        ("racks = []", "key 'name'"),
        ("name = 'x'", "'racks' must be a non-empty"),
        ("name = 'x'\n[[racks]]\nmachines = [{ gpus = 0 }]", r"racks\[0\].machines\[0\].gpus must be a positive"),
        ("name = 'x'\n[[racks]]\nmachines = [{ gpus = 8, slots = 3 }]", "cannot be split evenly"),
        ("name = 'x'\n[[racks]]\nmachines = [{ gpus = 8, colour = 1 }]", "unknown key 'colour'"),
        ("name = 'x'\n[[racks]]\nmachines = [{ slots = 2 }]", "missing key 'gpus'"),
        ("name = 'x'\n[[racks]]\nname = 'a'\nmachines = [{gpus = 1}]\n[[racks]]\nname = 'a'\nmachines = [{gpus = 1}]",
         "used twice"),
        ("name = 'x'\nextra = 1\n[[racks]]\nmachines = [{gpus = 1}]", "unknown key 'extra'"),
    ],
)
def test_bad_cluster_files_name_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ClusterFileError, match=message) as info:
        load_cluster(path)
    assert str(path) in str(info.value)


def test_unknown_cluster_name_lists_the_shipped_ones():
    with pytest.raises(ClusterFileError, match="testbed-64"):
        load_cluster("no-such-cluster")
