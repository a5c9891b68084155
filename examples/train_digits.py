"""One trial of the digits searches: a small scikit-learn MLP on ``load_digits()``, really trained.

The launcher runs this once per job run; it resumes from its checkpoint, trains one epoch per
iteration (``partial_fit``), reports the validation log-loss (and accuracy) after each, and stops when
``agent.job`` says so (SIGTERM from the launcher, or the tuner's target iteration reached), saving a
checkpoint first. The data ship inside scikit-learn (1,797 8x8 images): nothing is downloaded.

Hyperparameters (``THEMIS_PARAMS``, or ``--params`` by hand): ``hidden`` (units per layer), ``layers``,
``solver`` (adam or sgd), ``lr``, ``alpha`` (L2), ``batch``, ``momentum`` (sgd), ``seed``, and
``epochs``, the epochs one iteration trains (an iteration is the tuner's unit of work: rungs, caps).

By hand: ``python examples/train_digits.py --params '{"hidden": 64, "lr": 0.003}' --iterations 10``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import numpy as np
from sklearn.datasets import load_digits
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import log_loss
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier

from agent.job import Job

CLASSES = np.arange(10)


def data():
    """The fixed split every trial uses: 75% train, 25% validation, stratified, seed 0."""
    x, y = load_digits(return_X_y=True)
    return train_test_split(x / 16.0, y, test_size=0.25, random_state=0, stratify=y)


def model(params: dict) -> MLPClassifier:
    layers = (int(params.get("hidden", 64)),) * int(params.get("layers", 1))
    solver = params.get("solver", "adam")
    return MLPClassifier(
        hidden_layer_sizes=layers, solver=solver, learning_rate_init=float(params.get("lr", 1e-3)),
        alpha=float(params.get("alpha", 1e-4)), batch_size=int(params.get("batch", 64)),
        momentum=float(params.get("momentum", 0.9)), random_state=int(params.get("seed", 0)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default=None, help="JSON hyperparameters (default: THEMIS_PARAMS)")
    parser.add_argument("--iterations", type=int, default=1000, help="stop here at the latest")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=ConvergenceWarning)

    job = Job.from_env()  # (1) what the launcher says: params, checkpoint, where to report
    params = json.loads(args.params) if args.params else job.params
    epochs = int(params.get("epochs", 1))
    x_train, x_val, y_train, y_val = data()
    state = job.resume() or {"iteration": 0, "model": model(params)}
    clf, iteration = state["model"], state["iteration"]
    loss = accuracy = float("nan")
    print(f"{job.job_id or 'trial'}: {params} from iteration {iteration}", flush=True)
    while iteration < args.iterations and not job.should_stop(iteration):  # at its target already: nothing to train
        for _ in range(epochs):
            clf.partial_fit(x_train, y_train, classes=CLASSES)  # one epoch each
        iteration += 1
        proba = clf.predict_proba(x_val)
        loss = float(log_loss(y_val, proba, labels=CLASSES))
        accuracy = float((proba.argmax(1) == y_val).mean())
        if job.step(iteration, loss, accuracy=accuracy):  # (2) report; stop when asked
            break
    job.save({"iteration": iteration, "model": clf})
    print(f"{job.job_id or 'trial'}: stopped at iteration {iteration}, val loss {loss:.4f}, "
          f"accuracy {accuracy:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
