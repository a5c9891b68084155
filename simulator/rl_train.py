"""Train DeepShare's RL policy with stable-baselines3's PPO on its training episodes, and evaluate one
(needs the ``rl`` extra).

    python -m simulator.rl_train train --out data/rl/deepshare-rl.zip --steps 60000
    python -m simulator.rl_train evaluate --model data/rl/deepshare-rl.zip --trace data/deepshare/traces/real/trace0.json

``train`` runs PPO (seeds/002, section IV: "trained with PPO from stable-baselines3") on
``simulator.rl_env.DeepShareEnv`` over the nine training episodes (``data/deepshare/traces/train``),
each episode ``--jobs`` consecutive jobs of one of them (default 64: the rounds' cost grows with the
queue, so four shorter episodes cost less than one of 256 and teach the same decisions; 0 for whole
traces), and writes the network with what it was trained for and how long it took
(``simulator.rl_model``). A line every rollout shows steps, episodes, their mean return and JCT,
elapsed time and the time left. Torch runs on one thread (the network is small).

``evaluate`` runs a trace with a model, its RL-Hybrid variant and a random decider (uniformly one
of the valid placements, seeded) and prints average and p90 JCT and the mean contention ratio.

What differs from the paper: it trained each of five reward branches on 10 job sets x 20 episodes of
256 jobs; the shipped policy is one branch (w1 = 0.4, its branch B, the one its headline numbers
use), trained for the 60,000 steps (about 500 episodes of 64 jobs) a 2-core machine does in about
ten minutes. PPO's settings are stable-baselines3's defaults but for: the actor-critic masks
invalid actions (``simulator.rl_model.MaskedActorCritic``), rewards are scaled by the running
spread of returns (``VecNormalize``), gamma is 0.999 (a step is a decision, not a round: several
share an instant, and a per-step discount would pay a policy for making more of them), and
rollouts of 1,024 steps in batches of 128, 5 epochs. Without the scaling, and with the drain after
the last decision charged as one lump (``simulator.rl_env``), the critic explained none of the
returns' variance after 16,000 steps (0.87 with both) and PPO drifted towards saying nothing (87%
of its actions, against 45%).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from simulator.rl_policy import MODEL, DeepShareRLHybridPolicy, DeepShareRLPolicy, RandomDecider, require_rl
from simulator.rl_state import W1

DEFAULTS = {"steps": 60000, "jobs": 64, "w1": W1, "seed": 0, "net": (64, 64), "n_steps": 1024, "batch": 128,
            "epochs": 5, "lr": 3e-4, "ent": 0.01, "gamma": 0.999}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def train(out: str | Path, *, steps: int = DEFAULTS["steps"], jobs: int = DEFAULTS["jobs"], w1: float = W1,
          seed: int = 0, reward: str = "time", preempt_at: float | None = None, net: Sequence[int] = DEFAULTS["net"],
          n_steps: int = DEFAULTS["n_steps"], batch: int = DEFAULTS["batch"], epochs: int = DEFAULTS["epochs"],
          lr: float = DEFAULTS["lr"], ent: float = DEFAULTS["ent"], gamma: float = DEFAULTS["gamma"],
          progress: Callable[[str], None] | None = say) -> Path:
    """Train a policy and write it to ``out`` (module docstring); returns the file."""
    require_rl()
    if steps < 1 or n_steps < 2 or batch < 2:
        raise ValueError(f"steps, n_steps and batch must be positive (got {steps}, {n_steps}, {batch})")
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from benchmarks.machine import machine_info
    from simulator.rl_env import DeepShareEnv
    from simulator.rl_model import MaskedActorCritic, TrainedModel

    torch.set_num_threads(1)
    env = DeepShareEnv(jobs=jobs, w1=w1, reward=reward, preempt_at=preempt_at)
    env.reset(seed=seed)
    load_before = os.getloadavg()
    started = time.monotonic()
    episodes: list[dict[str, Any]] = []

    class Progress(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                if "episode_summary" in info:
                    episodes.append(info["episode_summary"])
            return True

        def _on_rollout_end(self) -> None:
            if progress is None:
                return
            done = self.num_timesteps
            spent = time.monotonic() - started
            recent = episodes[-10:]
            ret = math.fsum(e["return"] for e in recent) / len(recent) if recent else math.nan
            jct = math.fsum(e["avg_jct_s"] for e in recent) / len(recent) / 3600 if recent else math.nan
            progress(f"train-rl: {done} of {steps} steps, {len(episodes)} episodes (last 10: return {ret:.1f}, "
                     f"avg JCT {jct:.2f} h), {_clock(spent)} elapsed, {_clock(max(0.0, spent / done * (steps - done)))} left")

    venv = VecNormalize(DummyVecEnv([lambda: env]), norm_obs=False, norm_reward=True, gamma=gamma)
    model = PPO(MaskedActorCritic, venv, n_steps=n_steps, batch_size=batch, n_epochs=epochs, learning_rate=lr,
                ent_coef=ent, gamma=gamma, seed=seed, device="cpu", verbose=0,
                policy_kwargs={"net_arch": list(net), "layout": env.layout})
    model.learn(total_timesteps=steps, callback=Progress())
    seconds = time.monotonic() - started
    env.close()
    meta = {"net_arch": list(net), "w1": w1, "w2": 1.0 - w1, "reward": reward, "steps": model.num_timesteps, "episodes": len(episodes),
            "jobs_per_episode": jobs or "whole trace", "preempt_at": preempt_at, "seed": seed,
            "ppo": {"n_steps": n_steps, "batch_size": batch, "n_epochs": epochs, "learning_rate": lr, "ent_coef": ent,
                    "gamma": gamma},
            "traces": [p.name for p in env.traces], "train_seconds": round(seconds, 1),
            "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
            "machine": machine_info(), "versions": _versions()}
    path = TrainedModel(model.policy, env.layout, meta).save(out)
    if progress is not None:
        progress(f"train-rl: {model.num_timesteps} steps, {len(episodes)} episodes in {_clock(seconds)} "
                 f"(load {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after); wrote {path} "
                 f"({path.stat().st_size / 1e6:.2f} MB)")
    return path


def _versions() -> dict[str, str]:
    from importlib import metadata

    return {p: metadata.version(p) for p in ("torch", "stable-baselines3", "gymnasium")}


def evaluate(trace: str | Path, *, model: str | Path | None = None, jobs: int = 0, seed: int = 0,
             preempt_at: float | None = None) -> dict[str, dict[str, float]]:
    """Average and p90 JCT (from submission) and the mean contention ratio of the model, its
    RL-Hybrid variant and a random decider on ``trace`` (its first ``jobs``; 0: all), in
    DeepShare's setting (``simulator.rl_env.SETTING``)."""
    require_rl()
    from simulator.rl_model import TrainedModel

    trained = TrainedModel.load(model or MODEL)
    deciders = {"deepshare-rl": lambda: DeepShareRLPolicy(decide=trained),
                "deepshare-rl-hybrid": lambda: DeepShareRLHybridPolicy(decide=trained),
                "random": lambda: DeepShareRLPolicy(decide=RandomDecider(seed))}
    return {name: run_policy(make(), trace, jobs=jobs, seed=seed, preempt_at=preempt_at)
            for name, make in deciders.items()}


def run_policy(policy, trace: str | Path, *, jobs: int = 0, seed: int = 0,
               preempt_at: float | None = None) -> dict[str, float]:
    """One simulation of ``policy`` on a DeepShare trace in DeepShare's setting; its JCT numbers."""
    from arbiter.cluster import load_cluster
    from simulator.contention import ContentionModel
    from simulator.deepshare_experiment import deepshare_jct
    from simulator.engine import Simulation
    from simulator.metrics import percentile
    from simulator.rl_env import SETTING
    from simulator.workloads.deepshare import load_trace

    sim = Simulation(load_cluster(SETTING["cluster"]), load_trace(trace, jobs=jobs, seed=seed), policy,
                     lease_s=SETTING["lease_s"], restart_s=SETTING["restart_s"], seed=seed,
                     contention=ContentionModel.load(SETTING["table"], preempt_at))
    result = sim.run()
    jct = [r.finished_at - r.spec.arrival_s for r in result.apps]
    acc = [r.contention for r in result.apps if r.contention is not None]
    ran = [deepshare_jct(a.running_s) for a in acc]
    gpu_s = math.fsum(a.gpu_s for a in acc)
    return {"avg_jct_s": math.fsum(jct) / len(jct), "p90_jct_s": percentile(jct, 90),
            "deepshare_avg_jct_s": math.fsum(ran) / len(ran), "deepshare_p90_jct_s": percentile(ran, 90),
            "makespan_s": result.makespan,
            "mean_contention_ratio": math.fsum(a.ratio_gpu_s for a in acc) / gpu_s if gpu_s else 1.0}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulator.rl_train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy with PPO and write it")
    p.add_argument("--out", type=Path, required=True, help="the model file to write (.zip)")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="PPO time steps (decisions)")
    p.add_argument("--jobs", type=int, default=DEFAULTS["jobs"], help="jobs per episode (0: whole traces)")
    p.add_argument("--w1", type=float, default=W1, help="the reward's contention weight; w2 = 1 - w1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", choices=("time", "round"), default="time",
                   help="Eq. 2 as a cost over simulated time (default) or per decision as the paper (simulator.rl_env)")
    p.add_argument("--preempt-at", type=float, default=None, help="DeepShare's preemption ratio (0.6), off by default")
    p.add_argument("--net", default="64,64", help="hidden layers of the actor and the critic")
    p = sub.add_parser("evaluate", help="a model, RL-Hybrid and random on one trace")
    p.add_argument("--model", type=Path, default=None, help=f"a model file (default {MODEL})")
    p.add_argument("--trace", type=Path, required=True, help="a DeepShare trace (JSON)")
    p.add_argument("--jobs", type=int, default=0, help="its first JOBS jobs (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preempt-at", type=float, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            net = tuple(int(x) for x in args.net.split(",") if x.strip())
            train(args.out, steps=args.steps, jobs=args.jobs, w1=args.w1, seed=args.seed, reward=args.reward,
                  preempt_at=args.preempt_at, net=net)
        else:
            for name, row in evaluate(args.trace, model=args.model, jobs=args.jobs, seed=args.seed,
                                      preempt_at=args.preempt_at).items():
                print(f"{name:20} avg JCT {row['avg_jct_s'] / 3600:6.2f} h, p90 {row['p90_jct_s'] / 3600:6.2f} h; "
                      f"DeepShare's {row['deepshare_avg_jct_s'] / 3600:5.2f} h, p90 {row['deepshare_p90_jct_s'] / 3600:5.2f} h; "
                      f"makespan {row['makespan_s'] / 3600:6.2f} h; mean ratio {row['mean_contention_ratio']:.3f}")
    except ValueError as exc:
        say(f"python -m simulator.rl_train: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
