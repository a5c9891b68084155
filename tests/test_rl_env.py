"""DeepShare's RL policy over our simulator (seeds/002, section IV): the state, action and reward on a
hand-made cluster with values from the contention table, the gymnasium environment (spaces, the
environment checker, the reward it pays), a short PPO training so that training cannot rot, the
policy by name through ``themis-sim``, the simulator without torch, and the shipped policy against
a random one on the held-out trace."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from arbiter.cluster import load_cluster
from arbiter.contention import FLOOR, load_table
from simulator.contention import ContentionModel
from simulator.engine import Simulation
from simulator.rl_env import HELD_OUT, ROUND_S, TRAIN_TRACES, DeepShareEnv
from simulator.rl_model import TrainedModel
from simulator.rl_policy import MODEL, DeepShareRLPolicy, RandomDecider
from simulator.rl_state import (
    ACTION_FEATURES,
    GLOBALS,
    NOTHING,
    Candidate,
    Formulation,
    Job,
    Layout,
    Snapshot,
    ewma_after,
)
from simulator.rl_train import run_policy, train
from simulator.workloads.deepshare import load_trace

ROOT = Path(__file__).resolve().parents[1]
TABLE_CSV = ROOT / "agent" / "profiles" / "contention_deepshare.csv"


def cell(target: str, neighbour: str) -> float:
    """A value of DeepShare's table, read from the CSV itself."""
    rows = list(csv.reader(TABLE_CSV.open(encoding="utf-8-sig")))
    col = rows[0].index(neighbour)
    return next(float(row[col]) for row in rows[1:] if row[0] == target)


@pytest.fixture(scope="module")
def formulation() -> Formulation:
    table = load_table("deepshare")
    return Formulation(Layout.for_cluster({f"n{i}": 8 for i in range(4)}, table.classes), table, FLOOR)


def hand_made(layout: Layout) -> Snapshot:
    """MoE on nodes 0+1 (4 + 4 GPUs), FSDP on 1+2 (2 + 2), GraphSage on 2+3 (1 + 1), DLRM on node 3
    alone (4); a GraphSage 2-GPU, an FSDP 4-GPU and a MoE 8-GPU job wait."""
    placed = [Job("moe", "MoE", ((0, 4), (1, 4))), Job("fsdp", "FSDP", ((1, 2), (2, 2))),
              Job("gs", "GraphSage", ((2, 1), (3, 1))), Job("dlrm", "DLRM", ((3, 4),))]
    cands = [Candidate("c8", "MoE", 8), Candidate("c2", "GraphSage", 2), Candidate("c4", "FSDP", 4)]
    return Snapshot.of(layout, placed, [4, 2, 5, 3], cands, waiting=40, ewma=0.5, now=600.0)


def test_the_state_action_and_reward_of_a_hand_made_cluster(formulation: Formulation):
    lay = formulation.layout
    assert lay.subsets == ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 1, 2, 3))  # DeepShare's seven lists
    assert lay.n_actions == 1 + 3 * 7
    point = formulation.point(hand_made(lay))
    # D35 on the table's values: the worst multi-node neighbour on a shared node; one node untouched
    moe, fsdp, gs = cell("MoE,8,2", "FSDP,4,2"), min(cell("FSDP,4,2", "MoE,8,2"), cell("FSDP,4,2", "GraphSage,2,2")), \
        cell("GraphSage,2,2", "FSDP,4,2")
    assert (moe, fsdp, gs) == (0.438, 0.686, 0.903)
    assert formulation.ratios(point.snapshot.placed) == {"moe": moe, "fsdp": fsdp, "gs": gs, "dlrm": 1.0}
    contention = ((1 - moe) + (1 - fsdp) + (1 - gs) + 0.0) / 4
    assert point.contention == pytest.approx(contention)
    assert point.util == 18 / 32
    assert point.ewma == pytest.approx(0.5 * 9 / 11 + 18 / 32 * 2 / 11)  # EWMA of span 10
    assert point.reward(0.4) == pytest.approx(-0.4 * contention + 0.6 * point.ewma)
    assert point.reward(0.7) == pytest.approx(-0.7 * contention + 0.3 * point.ewma)
    # candidates by demand; valid: GraphSage on any pair (1 + 1), FSDP on any pair (2 + 2) or all four
    # (1 each), MoE on the one pair with 4 free on both (nodes 0 and 2) or all four (2 each)
    assert [c.app for c in point.snapshot.candidates] == ["c2", "c4", "c8"]
    valid = {lay.decode(a) for a in point.placements}
    assert valid == {(0, s) for s in lay.subsets[:6]} | {(1, s) for s in lay.subsets} | {(2, (0, 2)), (2, (0, 1, 2, 3))}
    assert point.valid[NOTHING]
    # each valid action's features agree with D35 recomputed on the placement it makes
    feats = point.obs[math.prod(lay.grid_shape):-GLOBALS].reshape(lay.n_actions - 1, ACTION_FEATURES)
    for action in point.placements:
        k, subset = lay.decode(action)
        job = formulation.job_on(point.snapshot.candidates[k], subset)
        after = formulation.ratios({**point.snapshot.placed, job.app: job})
        hit = [after[a] for a, j in point.snapshot.placed.items() if len(j.per_node) > 1 and j.node_set & job.node_set]
        assert feats[action - 1] == pytest.approx([1.0, after[job.app], min(hit, default=1.0),
                                                   sum(after.values()) / len(after)], abs=1e-6), action
        assert point.after[action] == pytest.approx(1 - sum(after.values()) / len(after), abs=1e-6)
    assert not feats[[a - 1 for a in range(1, lay.n_actions) if not point.valid[a]], 0].any()
    # the grid: node 0's first four GPUs hold MoE at its ratio; the MoE candidate sits at 2 nodes x 4
    grid = point.obs[:math.prod(lay.grid_shape)].reshape(lay.grid_shape)
    c = len(lay.classes)
    moe_class = 1 + lay.classes.index("MoE")
    assert grid[0, 0].tolist() == [1.0] * 4 + [0.0] * 12
    assert grid[moe_class, 0, :4].tolist() == [1.0] * 4 and grid[c + 3, 0, 0] == pytest.approx(moe)
    assert grid[0, 1, 8 + 3] == 1.0 and grid[moe_class, 1, 8 + 3] == 1.0 and grid[c + 4, 1, 8 + 3] == 1.0
    assert grid[0, 3, 8 + 1] == 1.0 and grid[moe_class, 3, 8 + 1] == 1.0  # 4 nodes x 2
    assert point.obs.min() >= 0.0 and point.obs.max() <= 1.0 and point.obs.dtype == np.float32


def test_an_empty_cluster_cannot_choose_to_wait(formulation: Formulation):
    lay = formulation.layout
    point = formulation.point(Snapshot.of(lay, [], [8] * 4, [Candidate("a", "MoE", 8)], 1, None))
    assert not point.valid[NOTHING] and len(point.placements) == 7
    assert point.contention == 0.0 and point.util == 0.0 and point.ewma == 0.0
    assert ewma_after(None, 0.25) == 0.25


def test_the_environment_spaces_and_the_checker():
    env = DeepShareEnv(jobs=10)
    assert env.observation_space.shape == (env.layout.obs_size,) == (11 * 4 * 16 + 21 * 4 + 4,)
    assert env.action_space.n == 22
    assert len(TRAIN_TRACES) == 9 and HELD_OUT.name == "trace0.json"
    check_env(env, skip_render_check=True)
    env.close()


def test_the_time_reward_charges_the_idle_gpu_time_the_simulator_ran():
    """With w1 = 0 an episode's return is minus its idle GPU time over the cluster, in rounds, from
    its first decision to its last (the drain after it is not charged): -(last - first - busy
    GPU-seconds between them / 32) / 300, from the simulator's own accounting."""
    env = DeepShareEnv(jobs=12, w1=0.0)
    obs, info = env.reset(seed=3, options={"trace": str(TRAIN_TRACES[0]), "offset": 20})
    first, busy_first = info["now"], info["busy_gpu_s"]
    rng = np.random.default_rng(0)
    total, done, last = 0.0, False, info
    while not done:
        choices = np.flatnonzero(info["valid"])
        obs, reward, done, truncated, info = env.step(int(rng.choice(choices)))
        assert reward <= 1e-12 and not truncated
        total += reward
        last = info if not done else last
    summary = info["episode_summary"]
    idle = (last["now"] - first) - (last["busy_gpu_s"] - busy_first) / 32
    assert idle > 0 and total == pytest.approx(-idle / ROUND_S)
    assert summary["jobs"] == 12 and summary["offset"] == 20 and summary["return"] == pytest.approx(total)
    assert summary["makespan_s"] > last["now"] and info["busy_gpu_s"] > last["busy_gpu_s"]
    env.close()


def test_the_round_reward_is_eq2_at_the_next_decision_point():
    env = DeepShareEnv(jobs=8, w1=0.4, reward="round")
    obs, info = env.reset(seed=1)
    rewards = []
    for _ in range(6):
        obs, reward, done, _, info = env.step(int(np.flatnonzero(info["valid"])[-1]))
        if done:
            break
        assert reward == pytest.approx(-0.4 * info["contention"] + 0.6 * info["ewma"])
        rewards.append(reward)
    assert rewards
    env.close()


def test_a_short_training_writes_a_small_model_that_runs_as_a_policy(tmp_path):
    lines: list[str] = []
    path = train(tmp_path / "m.zip", steps=256, jobs=10, n_steps=128, batch=64, epochs=2, progress=lines.append)
    assert path.stat().st_size < 1_000_000
    assert any("256 of 256 steps" in line for line in lines) and "wrote" in lines[-1]
    model = TrainedModel.load(path)
    assert model.meta["steps"] == 256 and model.meta["reward"] == "time" and model.meta["train_seconds"] > 0
    assert model.layout.same_shape(DeepShareEnv().layout)
    row = run_policy(DeepShareRLPolicy(model=path), HELD_OUT, jobs=16)
    assert row["avg_jct_s"] > 0 and 0 < row["mean_contention_ratio"] <= 1


def test_the_policy_needs_contention_and_the_layout_it_was_trained_for(tmp_path):
    work = load_trace(HELD_OUT, jobs=4)
    with pytest.raises(ValueError, match="needs the simulator's contention model"):
        Simulation(load_cluster("deepshare-4x8"), work, DeepShareRLPolicy(decide=RandomDecider(0)), lease_s=300).run()
    two = tmp_path / "two.toml"
    two.write_text('name = "two"\n[[racks]]\nmachines = [{ gpus = 8, slots = 1, count = 2 }]\n')
    with pytest.raises(ValueError, match=r"trained for 4 nodes x 8 GPUs.*give 2 nodes x 8 GPUs"):
        Simulation(load_cluster(str(two)), work, DeepShareRLPolicy(model=MODEL), lease_s=300,
                   contention=ContentionModel.load("deepshare")).run()
    with pytest.raises(ValueError, match="20 nodes are too many"):
        Simulation(load_cluster("testbed-64"), work, DeepShareRLPolicy(model=MODEL), lease_s=300,
                   contention=ContentionModel.load("deepshare")).run()
    with pytest.raises(ValueError, match="no such model file; train one with python -m simulator.rl_train"):
        DeepShareRLPolicy(model=tmp_path / "none.zip")


def test_deepshare_rl_runs_by_name_through_themis_sim(tmp_path):
    from simulator.cli import main

    out = tmp_path / "run"
    assert main(["run", "--policy", "deepshare-rl-hybrid", "--cluster", "deepshare-4x8", "--workload",
                 f"deepshare:{HELD_OUT}", "--workload-knob", "jobs=12", "--lease", "300", "--restart", "0",
                 "--contention", "deepshare", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "deepshare-rl-hybrid" and summary["apps_count"] == 12
    assert 0 < summary["mean_contention_ratio"] <= 1


def test_the_simulator_imports_and_runs_without_torch(tmp_path):
    code = ("import sys; sys.modules['torch'] = None; sys.modules['stable_baselines3'] = None\n"
            "from simulator.cli import main\n"
            "from simulator.plugins import load_from_env; load_from_env()\n"
            "from arbiter.policies import POLICIES, make_policy\n"
            "assert 'deepshare-rl' in POLICIES\n"
            "try:\n    make_policy('deepshare-rl')\nexcept ValueError as exc:\n    print(exc)\n"
            f"assert main(['run', '--workload', 'small', '--out', {str(tmp_path / 'small')!r}]) == 0\n"
            "assert sys.modules['torch'] is None\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "THEMIS_PLUGINS": ""})
    assert done.returncode == 0, done.stderr
    assert "needs the optional 'rl' extra (torch is not installed): pip install 'themis-scheduler[rl]'" in done.stdout


def test_the_shipped_policy_beats_a_random_one_on_the_held_out_trace():
    """real0 is not among the training episodes. Random: uniformly one of the valid placements,
    seeded (never idle while a job fits, so it is the same run-to-completion loop, unguided)."""
    model = TrainedModel.load(MODEL)
    assert MODEL.stat().st_size < 1_000_000
    assert model.meta["traces"] == [p.name for p in TRAIN_TRACES] and HELD_OUT.name not in model.meta["traces"]
    trained = run_policy(DeepShareRLPolicy(decide=model), HELD_OUT)
    random = run_policy(DeepShareRLPolicy(decide=RandomDecider(0)), HELD_OUT)
    assert trained["avg_jct_s"] < 0.99 * random["avg_jct_s"]
    assert trained["deepshare_avg_jct_s"] < random["deepshare_avg_jct_s"]
    assert trained["mean_contention_ratio"] > random["mean_contention_ratio"]
