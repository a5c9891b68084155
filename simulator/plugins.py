"""Policies, workloads and bidding strategies from outside the repository (issue 13 item 6).

A researcher extends the simulator without editing it, the way Optuna takes a new sampler: one
file that registers what it adds, named on the command line or installed as a package.

- ``themis-sim compare --plugin my_policy.py --policies themis,srgf ...``: ``--plugin`` takes a
  ``.py`` file or an importable module name; importing it runs its registrations
  (``arbiter.policies.register_policy``, ``simulator.workloads.register``,
  ``simulator.strategic.strategy``).
- An installed package declares entry points in the groups ``themis.policies`` (a ``Policy``
  subclass or a module), ``themis.workloads`` (a workload builder, registered under the entry
  point's name, or a module) and ``themis.strategies`` (a ``BiddingStrategy`` subclass or a
  module); every ``themis-sim`` command loads them.

Seeds run in worker processes (``simulator.seeds.run_parallel``), which need the same names: the
plugins given on the command line are recorded in the environment variable ``THEMIS_PLUGINS``,
which the workers inherit and :func:`load_from_env` (called by every simulation) imports again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from pathlib import Path
from types import ModuleType

__all__ = ["ENV", "GROUPS", "PluginError", "load_builtin", "load_entry_points", "load_from_env", "load_plugins"]

ENV = "THEMIS_PLUGINS"
GROUPS = ("themis.policies", "themis.workloads", "themis.strategies")
_LOADED: dict[str, ModuleType] = {}
_ENTRY_POINTS_LOADED = False


class PluginError(ValueError):
    """A plugin that cannot be loaded; the message names it and says why."""


def _import(spec: str) -> ModuleType:
    """A ``.py`` file (by path) or a module (by dotted name), imported once per process."""
    if spec in _LOADED:
        return _LOADED[spec]
    if spec.endswith(".py"):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"plugin {spec!r}: no such file")
        name = f"themis_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"  # same in workers
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise PluginError(f"plugin {spec!r}: cannot be imported as a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise PluginError(f"plugin {spec!r} failed while importing: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as exc:
            raise PluginError(f"plugin {spec!r}: cannot import it ({exc}); give a .py path or an "
                              f"importable module name") from exc
        except Exception as exc:
            raise PluginError(f"plugin {spec!r} failed while importing: {type(exc).__name__}: {exc}") from exc
    _LOADED[spec] = module
    return module


def _spec_key(spec: str) -> str:
    return str(Path(spec).expanduser().resolve()) if spec.endswith(".py") else spec


def load_plugins(specs: Sequence[str]) -> list[ModuleType]:
    """Import each plugin and record it in ``THEMIS_PLUGINS`` for the worker processes."""
    keys = [_spec_key(s) for s in specs if s.strip()]
    modules = [_import(k) for k in keys]
    known = [k for k in os.environ.get(ENV, "").split(os.pathsep) if k]
    os.environ[ENV] = os.pathsep.join(dict.fromkeys(known + keys))
    return modules


def load_from_env() -> None:
    """The simulator's own policies from outside ``arbiter.policies``, the plugins a parent process
    recorded, and the installed entry points (idempotent)."""
    load_builtin()
    for key in os.environ.get(ENV, "").split(os.pathsep):
        if key:
            _import(key)
    load_entry_points()


def load_builtin() -> None:
    """Register the policies the simulator adds itself, whose dependencies keep them out of the
    arbiter's layer: DeepShare's RL policies (``simulator.rl_policy``; importing it needs no torch,
    making one does)."""
    from simulator.rl_policy import register

    register()


def _register(group: str, name: str, obj: object) -> None:
    from arbiter.policies import Policy, register_policy

    if isinstance(obj, ModuleType):
        return  # importing it ran its registrations
    if group == "themis.policies" and inspect.isclass(obj) and issubclass(obj, Policy):
        register_policy(obj)
    elif group == "themis.strategies":
        from simulator.strategic import BiddingStrategy, strategy

        if not (inspect.isclass(obj) and issubclass(obj, BiddingStrategy)):
            raise PluginError(f"entry point {name!r} in {group}: expected a BiddingStrategy subclass, got {obj!r}")
        strategy(obj)
    elif group == "themis.workloads" and callable(obj):
        from simulator.workloads import register

        register(name)(obj)
    else:
        raise PluginError(f"entry point {name!r} in {group}: expected a Policy subclass or a module, got {obj!r}")


def load_entry_points() -> None:
    """Load every installed entry point of :data:`GROUPS` once per process."""
    global _ENTRY_POINTS_LOADED
    if _ENTRY_POINTS_LOADED:
        return
    for group in GROUPS:
        for ep in entry_points(group=group):
            try:
                obj = ep.load()
            except Exception as exc:
                raise PluginError(f"entry point {ep.name!r} in {group} ({ep.value}) failed to load: "
                                  f"{type(exc).__name__}: {exc}") from exc
            _register(group, ep.name, obj)
    _ENTRY_POINTS_LOADED = True
