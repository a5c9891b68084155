"""One trial of the PyTorch search: a real PyTorch model on scikit-learn's digits, trained with AdamW.

The launcher runs this once per job run. It trains on the GPU its lease names when CUDA is there
(``CUDA_VISIBLE_DEVICES`` is set by the launcher; bf16 autocast), on the CPU otherwise, and keeps
everything a resume needs in its ``agent.job`` checkpoint: the model's weights, the optimizer's state
(AdamW's step count and moments ``exp_avg``, ``exp_avg_sq``), the optimizer steps done and the RNG
state. A run stopped by SIGTERM (its lease was lost) finishes the optimizer step it is in, saves and
exits 0; the next run, wherever it lands, loads the checkpoint and goes on from the next batch of the
same epoch, so a restart changes neither the batches seen nor the optimizer's trajectory. The data
ship inside scikit-learn (1,797 8x8 images): nothing is downloaded.

An *iteration* (the tuner's unit: rungs, caps) is ``steps`` optimizer steps, one epoch by default.
After each iteration the job reports the validation loss, with ``accuracy``, ``step`` (optimizer
steps done), ``device`` and ``parameters`` (the model's) as extras; the first report of a resumed run
also says ``resumed_step`` and ``exp_avg_fingerprint`` (:func:`optimizer_fingerprint` of the state it
loaded), so whoever reads the reports can check the optimizer state against the checkpoint it came from.

Hyperparameters (``THEMIS_PARAMS``, or ``--params`` by hand):

* ``arch``: ``cnn`` (two 3x3 convolutions, ``width`` channels), ``mlp`` (``depth`` hidden layers of
  ``width`` units) or ``transformer`` (the image's 8 rows as tokens; ``depth`` pre-norm encoder layers
  of model width ``width``, heads of 64);
* ``lr``, ``weight_decay`` (AdamW), ``batch``, ``steps`` (per iteration), ``seed``, ``val`` (how many
  validation images to evaluate, default all 449), ``autocast`` (``auto``: bf16 on CUDA only; ``bf16``;
  ``off``).

By hand: ``python examples/train_torch.py --params '{"arch": "cnn", "lr": 0.003}' --iterations 5``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from agent.job import Job

ARCHS = ("cnn", "mlp", "transformer")
DEFAULTS: dict[str, Any] = {"arch": "cnn", "width": 16, "depth": 2, "lr": 3e-3, "weight_decay": 1e-2,
                            "batch": 64, "steps": None, "seed": 0, "val": None, "autocast": "auto"}


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, read from the file the package ships (what ``load_digits`` reads),
    without importing scikit-learn: its import would double every run's start-up."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("train_torch: the digits data ship with scikit-learn; pip install scikit-learn")
    table = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz",
                       delimiter=",", dtype=np.float32)
    return table[:, :-1] / 16.0, table[:, -1].astype(np.int64)


def data(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The fixed split every trial uses: a quarter of each class (shuffled with seed 0) for validation."""
    x, y = digits()
    rng = np.random.default_rng(0)
    val = np.sort(np.concatenate([rng.permutation(np.flatnonzero(y == c))[: round(0.25 * np.sum(y == c))]
                                  for c in range(10)]))
    train = np.setdiff1d(np.arange(len(y)), val)
    return tuple(torch.as_tensor(a).to(device) for a in (x[train], x[val], y[train], y[val]))


class Rows(nn.Module):
    """A small transformer encoder over the image's 8 rows (8 pixels each) as tokens."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(8, width))
        layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.view(-1, 8, 8)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))


def build(params: dict[str, Any]) -> nn.Module:
    arch, width, depth = params["arch"], int(params["width"]), int(params["depth"])
    if arch == "cnn":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                             nn.Linear(2 * width * 16, 10))
    if arch == "mlp":
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))
    if arch == "transformer":
        return Rows(width, depth)
    raise SystemExit(f"train_torch: unknown arch {arch!r}; choose from {', '.join(ARCHS)}")


def on_cpu(value: Any) -> Any:
    """A state dict with every tensor on the CPU, so a checkpoint written on a GPU loads anywhere."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_cpu(v) for v in value)
    return value


def optimizer_fingerprint(optimizer_state: dict[str, Any]) -> float:
    """The sum of squares of every ``exp_avg`` in an AdamW state dict, in float64 (0 for a fresh one)."""
    total = 0.0
    for key in sorted(optimizer_state["state"]):
        exp_avg = optimizer_state["state"][key].get("exp_avg")
        if exp_avg is not None:
            total += float(exp_avg.detach().to("cpu", torch.float64).pow(2).sum())
    return total


def batch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    """The same shuffle of epoch ``epoch`` in every run of the job, so a resume sees the same batches."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="JSON hyperparameters (default: THEMIS_PARAMS)")
    parser.add_argument("--iterations", type=int, default=1000, help="stop here at the latest")
    args = parser.parse_args(argv)

    job = Job.from_env()  # (1) what the launcher says: params, checkpoint, where to report
    params = {**DEFAULTS, **(json.loads(args.params) if args.params else job.params)}
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = params["autocast"] == "bf16" or (params["autocast"] == "auto" and device.type == "cuda")
    seed = int(params["seed"])
    torch.manual_seed(seed)
    x_train, x_val, y_train, y_val = data(device)
    if params["val"] is not None:
        x_val, y_val = x_val[: int(params["val"])], y_val[: int(params["val"])]
    batch = int(params["batch"])
    per_epoch = math.ceil(len(x_train) / batch)
    steps = int(params["steps"] or per_epoch)  # optimizer steps per iteration
    model = build(params).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(params["lr"]),
                                  weight_decay=float(params["weight_decay"]))

    state = job.resume()  # (2) the checkpoint of an earlier run of this job, or None
    step, resumed = 0, {}
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        step = int(state["step"])
        resumed = {"resumed_step": step, "exp_avg_fingerprint": optimizer_fingerprint(optimizer.state_dict())}
    iteration = step // steps
    print(f"{job.job_id or 'trial'}: {params} on {device}{' (bf16 autocast)' if autocast else ''}, "
          f"from step {step} (iteration {iteration})", flush=True)

    loss = accuracy = float("nan")
    began = time.monotonic()
    while iteration < args.iterations and not job.should_stop(iteration):  # at its target already: nothing to train
        model.train()
        while step < (iteration + 1) * steps:
            epoch, at = divmod(step, per_epoch)
            index = batch_order(seed, epoch, len(x_train))[at * batch:(at + 1) * batch].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                train_loss = F.cross_entropy(model(x_train[index]), y_train[index])
            optimizer.zero_grad(set_to_none=True)
            train_loss.backward()
            optimizer.step()
            step += 1
            if job.stop_requested:  # SIGTERM mid-iteration: save this step, the next run finishes the iteration
                break
        if step < (iteration + 1) * steps:
            break
        iteration += 1
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x_val).float()
        loss = float(F.cross_entropy(logits, y_val))
        accuracy = float((logits.argmax(1) == y_val).float().mean())
        extra = {"accuracy": accuracy, "step": step, "device": device.type, "parameters": parameters, **resumed}
        resumed = {}
        if job.step(iteration, loss, **extra):  # (3) report; True: stop (lease lost, rung reached, pruned)
            break
    job.save({"model": on_cpu(model.state_dict()), "optimizer": on_cpu(optimizer.state_dict()),  # (4) checkpoint
              "step": step, "rng": torch.get_rng_state()})
    print(f"{job.job_id or 'trial'}: saved at step {step} (iteration {iteration}) after "
          f"{time.monotonic() - began:.1f} s; val loss {loss:.4f}, accuracy {accuracy:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
