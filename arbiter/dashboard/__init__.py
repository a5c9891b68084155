"""The arbiter's web dashboard: the cluster, the apps, every round and the events, live or from a
recorded simulated run (docs/service.md, "Dashboard").

``start(host, port, source)`` serves a :class:`~arbiter.dashboard.source.DashboardSource` in the
running event loop; :class:`~arbiter.dashboard.memory.MemorySource` is the in-memory source a round
driver feeds, :class:`~arbiter.dashboard.feed.EngineFeed` feeds it from a ``RoundEngine``.
"""

from typing import Any

from arbiter.dashboard.feed import EngineFeed
from arbiter.dashboard.memory import MemorySource
from arbiter.dashboard.source import DashboardSource, Feed, NotKept

__all__ = ["Dashboard", "DashboardSource", "EngineFeed", "Feed", "MemorySource", "NotKept", "start"]


def __getattr__(name: str) -> Any:
    """The web server (aiohttp) is imported only when asked for: a simulation that records its
    rounds builds views and never serves them."""
    if name in ("Dashboard", "start"):
        from arbiter.dashboard import server

        return getattr(server, name)
    raise AttributeError(f"module 'arbiter.dashboard' has no attribute {name!r}")
