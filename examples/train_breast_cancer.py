"""One Optuna trial as a training script: the objective of ``examples/optuna_search.py``, turned inside out.

An Optuna objective ``objective(trial)`` suggests its hyperparameters, trains, calls
``trial.report(loss, step)`` and raises ``TrialPruned`` when ``trial.should_prune()``. Under Themis
each trial is a process of its own on the GPUs the app leased, so the objective becomes this script:

* the hyperparameters come in ``job.params`` (the search script's ``suggest`` drew them with the same
  ``trial.suggest_*`` calls the objective made);
* ``job.step(iteration, loss)`` replaces ``trial.report`` + ``trial.should_prune``: the runner reports
  to the study and prunes; ``step`` answers True when the trial was pruned, completed its
  ``max_resource`` iterations or lost its GPUs (lease), and the script then saves and exits 0;
* ``job.resume()`` / ``job.save()`` are new: a trial stopped because its lease went elsewhere goes on
  from its checkpoint on its next grant.

The model: scikit-learn's ``SGDClassifier`` (logistic regression; an iteration is ``EPOCHS``
``partial_fit`` epochs) on the breast-cancer data shipped with scikit-learn (569 samples; nothing is
downloaded).

By hand: ``python examples/train_breast_cancer.py --params '{"alpha": 1e-4, "eta0": 0.01}' --iterations 5``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import numpy as np
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import SGDClassifier
from sklearn.metrics import log_loss
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from agent.job import Job

CLASSES = np.array([0, 1])
EPOCHS = 50  # per iteration (the pruner's unit of work): ~50 ms on one core, so pruning saves real time


def data():
    """The fixed split every trial uses: 70% train, 30% validation, stratified, seed 0; standardised."""
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    scaler = StandardScaler().fit(x_train)
    return scaler.transform(x_train), scaler.transform(x_val), y_train, y_val


def model(params: dict) -> SGDClassifier:
    return SGDClassifier(loss="log_loss", alpha=float(params.get("alpha", 1e-4)),
                         learning_rate=str(params.get("learning_rate", "constant")),
                         eta0=float(params.get("eta0", 0.01)), random_state=int(params.get("seed", 0)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="JSON hyperparameters (default: THEMIS_PARAMS)")
    parser.add_argument("--iterations", type=int, default=1000, help="stop here at the latest")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    job = Job.from_env()                                   # was: def objective(trial)
    params = json.loads(args.params) if args.params else job.params   # was: trial.suggest_*(...)
    x_train, x_val, y_train, y_val = data()
    state = job.resume() or {"iteration": 0, "model": model(params)}  # new: a lost lease costs one epoch
    clf, iteration = state["model"], state["iteration"]
    loss = accuracy = float("nan")
    while iteration < args.iterations and not job.should_stop(iteration):  # a checkpoint at the target: train nothing
        for _ in range(EPOCHS):
            clf.partial_fit(x_train, y_train, classes=CLASSES)
        iteration += 1
        proba = np.clip(clf.predict_proba(x_val), 1e-7, 1 - 1e-7)
        loss = float(log_loss(y_val, proba, labels=CLASSES))
        accuracy = float((proba.argmax(1) == y_val).mean())
        if job.step(iteration, loss, accuracy=accuracy):   # was: trial.report(); if trial.should_prune(): raise
            break
    job.save({"iteration": iteration, "model": clf})        # new: the checkpoint, then exit 0
    print(f"{job.job_id or 'trial'} {params}: stopped at iteration {iteration}, val loss {loss:.4f}, "
          f"accuracy {accuracy:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
