"""Executors: where and how the launcher's jobs run (issue 6). See :mod:`agent.executors.base`."""

from agent.executors.base import (
    EXECUTORS,
    BadCommand,
    Executor,
    Handle,
    JobCommand,
    LaunchError,
    Status,
    make_executor,
    register,
)
from agent.executors.local import LocalExecutor
from agent.executors.ray import RayExecutor
from agent.executors.slurm import SlurmExecutor

__all__ = ["EXECUTORS", "BadCommand", "Executor", "Handle", "JobCommand", "LaunchError", "LocalExecutor", "RayExecutor", "SlurmExecutor", "Status", "make_executor",
           "register"]
