"""Restart cost per model (mechanism D32): measured, sourced, from ``agent/profiles/restart_costs.toml``.

A restart is what a lease that moves a job costs it (D11, D17): the old process is stopped by
SIGTERM and writes its checkpoint (model and optimizer state), then a new process starts, loads it
and trains up to its first finished step. The table keeps each *measurement* (a model trained with
PyTorch and AdamW on a named device: its checkpoint size and the ranges of stop and restart times
seen) with its source, and maps every model of the slowdown table (``agent/profiles/slowdowns.toml``)
to the measurement that stands for it, saying why. A model's restart cost is the midpoint of its
measurement's stop range plus the midpoint of its restart range: the time the job trains nowhere.

Nothing reads this table unless asked (``themis-sim --restart-costs``): the simulator's default
stays one restart delay for every model (D11's 35 s), so the published figures do not move (D32).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["SHIPPED_RESTART_TABLE", "Measurement", "RestartCost", "RestartCostError", "load_restart_costs",
           "read_table", "restart_delays"]

SHIPPED_RESTART_TABLE = "agent/profiles/restart_costs.toml"
MEASUREMENT_KEYS = ("what", "device", "checkpoint_mb", "stop_s", "restart_s", "source")
MODEL_KEYS = ("measurement", "source")


class RestartCostError(ValueError):
    """A restart-cost table that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class Measurement:
    name: str
    what: str
    device: str
    checkpoint_mb: float
    stop_s: tuple[float, float]  # min, max
    restart_s: tuple[float, float]  # min, max
    source: str

    @property
    def cost_s(self) -> float:
        """Midpoint of the stop range plus midpoint of the restart range."""
        return (self.stop_s[0] + self.stop_s[1]) / 2 + (self.restart_s[0] + self.restart_s[1]) / 2


@dataclass(frozen=True, slots=True)
class RestartCost:
    model: str
    measurement: Measurement
    source: str  # why this measurement stands for the model

    @property
    def cost_s(self) -> float:
        return self.measurement.cost_s


def _range(value: object, where: str) -> tuple[float, float]:
    if (not isinstance(value, list) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value)):
        raise RestartCostError(f"{where} must be [min, max] in seconds, got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if not 0 <= lo <= hi < float("inf"):
        raise RestartCostError(f"{where} must be finite seconds with 0 <= min <= max, got {value!r}")
    return lo, hi


def _text(entry: Mapping, key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise RestartCostError(f"{where}.{key} must be a non-empty string")
    return value.strip()


def _table(entry: object, where: str, keys: tuple[str, ...]) -> Mapping:
    if not isinstance(entry, Mapping):
        raise RestartCostError(f"{where} must be a table")
    unknown = sorted(set(entry) - set(keys))
    missing = [k for k in keys if k not in entry]
    if unknown or missing:
        raise RestartCostError(f"{where}: " + "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing {', '.join(missing)}"] if missing else [])) + f" (keys: {', '.join(keys)})")
    return entry


def _measurement(name: str, entry: object, label: str) -> Measurement:
    where = f"{label}: measurements.{name}"
    entry = _table(entry, where, MEASUREMENT_KEYS)
    size = entry["checkpoint_mb"]
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
        raise RestartCostError(f"{where}.checkpoint_mb must be a positive number, got {size!r}")
    return Measurement(name, _text(entry, "what", where), _text(entry, "device", where), float(size),
                       _range(entry["stop_s"], f"{where}.stop_s"), _range(entry["restart_s"], f"{where}.restart_s"),
                       _text(entry, "source", where))


def _read(text: str, label: str) -> tuple[dict[str, Measurement], dict[str, RestartCost]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RestartCostError(f"{label}: invalid TOML: {exc}") from None
    extra = sorted(set(data) - {"measurements", "models"})
    if extra:
        raise RestartCostError(f"{label}: unknown top-level key(s) {', '.join(extra)}; a table has "
                               "[measurements.<name>] and [models.<name>]")
    raw_measurements, raw_models = data.get("measurements"), data.get("models")
    if not isinstance(raw_measurements, Mapping) or not raw_measurements:
        raise RestartCostError(f"{label}: needs a non-empty [measurements] table")
    if not isinstance(raw_models, Mapping) or not raw_models:
        raise RestartCostError(f"{label}: needs a non-empty [models] table")
    measurements = {name: _measurement(name, entry, label) for name, entry in raw_measurements.items()}
    models: dict[str, RestartCost] = {}
    for name, entry in raw_models.items():
        where = f"{label}: models.{name}"
        entry = _table(entry, where, MODEL_KEYS)
        chosen = _text(entry, "measurement", where)
        if chosen not in measurements:
            raise RestartCostError(f"{where}.measurement {chosen!r} is not a measurement of this table "
                                   f"(known: {', '.join(sorted(measurements))})")
        models[name] = RestartCost(name, measurements[chosen], _text(entry, "source", where))
    return measurements, models


def load_restart_costs(path: str | Path | None = None) -> dict[str, RestartCost]:
    """Model -> restart cost, from ``path`` (a TOML file shaped like the shipped table) or the
    shipped table; :class:`RestartCostError` names the file and the key of anything wrong."""
    return read_table(path)[1]


def read_table(path: str | Path | None = None) -> tuple[dict[str, Measurement], dict[str, RestartCost]]:
    """The measurements and the models of a table (``path``, or the shipped one)."""
    if path is None:
        text = (resources.files("agent") / "profiles" / "restart_costs.toml").read_text(encoding="utf-8")
        return _read(text, SHIPPED_RESTART_TABLE)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RestartCostError(f"{path}: cannot read restart-cost table: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise RestartCostError(f"{path}: not UTF-8 text: {exc}") from None
    return _read(text, str(path))


def restart_delays(source: str | Path) -> dict[str, float]:
    """Model -> restart delay in seconds, for the simulator (D32): ``"profiles"`` is the shipped
    table, anything else a TOML file of the same form."""
    table = load_restart_costs(None if str(source) == "profiles" else source)
    return {model: cost.cost_s for model, cost in table.items()}
