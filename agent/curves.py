"""Predict where a job's loss curve says it will stop (paper 4.3.2, mechanism D4).

The fit is Optimus's form (seeds/004): loss(k) = 1 / (b0 * k + b1) + b2 with b0 > 0. For a fixed
asymptote b2 the model is linear in (b0, b1) after taking 1 / (loss - b2), so we scan b2 on a grid
below the smallest observed loss and solve each candidate by least squares. A job stops when its
predicted loss comes within ``tolerance`` of the asymptote. The spread of stop iterations among the
fits whose error is close to the best one is the prediction's error bar; D4 bids with its
pessimistic (latest) end, and the bar narrows as the job reports more values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class StopPrediction:
    optimistic: float  # earliest plausible stop iteration
    pessimistic: float  # latest plausible stop iteration (D4 uses this)


def predict_stop(
    iterations: Sequence[float],
    losses: Sequence[float],
    *,
    tolerance: float,
    max_iterations: float,
    near_best: float = 1.25,
) -> StopPrediction:
    """Stop iteration interval for one job from its (iteration, loss) reports.

    With fewer than 3 reports nothing can be fitted and the job is assumed to run to
    ``max_iterations`` (the pessimistic end of an unknown curve).
    """
    if tolerance <= 0:
        raise ValueError("tolerance must be > 0")
    k = np.asarray(iterations, dtype=float)
    y = np.asarray(losses, dtype=float)
    if k.shape != y.shape:
        raise ValueError("iterations and losses must have the same length")
    ok = np.isfinite(k) & np.isfinite(y)
    k, y = k[ok], y[ok]
    done = float(k.max()) if k.size else 0.0
    if k.size < 3 or float(np.ptp(y)) <= 0:
        return StopPrediction(min(max_iterations, max(done, 0.0)) if k.size >= 3 else max_iterations, max_iterations)
    lo = float(y.min())
    span = float(np.ptp(y))
    frac = np.linspace(0.0, 0.99, 34)
    b2 = lo - span * (1.0 - frac) - 1e-12
    b2[-1] = lo - 1e-9 * max(1.0, abs(lo))
    z = 1.0 / (y[None, :] - b2[:, None])  # one row per candidate asymptote
    # closed-form least squares of z = b0 k + b1, for every candidate at once
    k_mean = k.mean()
    k_var = ((k - k_mean) ** 2).sum()
    z_mean = z.mean(axis=1)
    b0 = ((k - k_mean)[None, :] * (z - z_mean[:, None])).sum(axis=1) / k_var if k_var > 0 else np.zeros(len(b2))
    b1 = z_mean - b0 * k_mean
    ok = b0 > 0
    if not ok.any():
        return StopPrediction(max_iterations, max_iterations)
    b0, b1, b2 = b0[ok], b1[ok], b2[ok]
    pred = 1.0 / (b0[:, None] * k[None, :] + b1[:, None]) + b2[:, None]
    rmse = np.sqrt(np.mean((pred - y[None, :]) ** 2, axis=1))
    stop = np.clip((1.0 / tolerance - b1) / b0, done, max_iterations)
    finite = np.isfinite(rmse) & np.isfinite(stop)
    if not finite.any():
        return StopPrediction(max_iterations, max_iterations)
    rmse, stop = rmse[finite], stop[finite]
    plausible = stop[rmse <= rmse.min() * near_best + 1e-12]
    return StopPrediction(float(plausible.min()), float(plausible.max()))
