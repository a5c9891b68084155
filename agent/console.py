"""What a search shows while it runs, with nothing to configure (issue 11, item 2).

A new user's four-minute search printed nothing: the runner logged through ``logging`` and nobody
had set logging up. :func:`show_progress_lines` gives the ``themis`` loggers a ``rich`` handler on
stderr (the runner's lines at INFO, everything else from WARNING), but only when the program
has configured no logging of its own (the root logger has no handlers), so an application's own set-up is never overridden. :class:`SearchProgress` is one
``rich`` progress display shared by every runner of the process (rich allows one live display at a
time): per app, trials done and the best loss so far.

``AppRunner(quiet=True)`` uses neither.
"""

from __future__ import annotations

import logging
import threading

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = ["SearchProgress", "show_progress_lines", "stderr_console"]

_lock = threading.RLock()
_console: Console | None = None
_handler: RichHandler | None = None


def stderr_console() -> Console:
    global _console
    with _lock:
        if _console is None:
            _console = Console(stderr=True)
        return _console


def show_progress_lines() -> bool:
    """Install the rich handler on the ``themis`` loggers unless logging is configured already (by
    the program, or by an earlier call). True when the lines will show."""
    global _handler
    themis = logging.getLogger("themis")
    if _handler is not None:
        return True
    if logging.getLogger().handlers or themis.handlers:
        return False
    handler = RichHandler(console=stderr_console(), show_path=False, markup=False, log_time_format="%H:%M:%S")
    handler.setLevel(logging.INFO)
    handler.addFilter(_lines_that_matter)
    themis.addHandler(handler)
    if themis.level == logging.NOTSET or themis.level > logging.INFO:
        themis.setLevel(logging.INFO)
    with _lock:
        _handler = handler
    return True


def _lines_that_matter(record: logging.LogRecord) -> bool:
    """The runner's lines (grants, revocations, trial results) at INFO; the rest (every process
    start and exit, stream details) only from WARNING up."""
    return record.name == "themis.runner" or record.levelno >= logging.WARNING


class SearchProgress:
    """One task per app on the process-wide progress display; the display stops with its last task."""

    _progress: Progress | None = None
    _tasks = 0

    def __init__(self, app: str, total: int | None) -> None:
        with _lock:
            if SearchProgress._progress is None:
                SearchProgress._progress = Progress(
                    TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("trials"),
                    TextColumn("{task.fields[best]}"), TimeElapsedColumn(), console=stderr_console(),
                    transient=False)
                SearchProgress._progress.start()
            SearchProgress._tasks += 1
            self._app = app
            self._task: TaskID = SearchProgress._progress.add_task(app, total=total, best="")

    def update(self, done: int, best: str) -> None:
        if SearchProgress._progress is not None:
            SearchProgress._progress.update(self._task, completed=done, best=best)

    def close(self) -> None:
        with _lock:
            progress = SearchProgress._progress
            if progress is None:
                return
            SearchProgress._tasks -= 1
            if SearchProgress._tasks <= 0:
                progress.stop()
                SearchProgress._progress, SearchProgress._tasks = None, 0
