"""The arbiter's journal: apps, leases, rounds, tokens and the contention history behind N_avg, in
SQLite (WAL), so that a restarted arbiter goes on where it stopped.

Every change the service makes (a round opening or closing, a release, a demand update, an admin
call) is written as one transaction holding the engine's whole :class:`~arbiter.rounds.EngineState`
-- a few hundred rows at most -- so the journal is never half-updated: after ``kill -9`` it holds
the state as of the last committed change. ``leases.gpu`` is the primary key, so no journal can
ever record one GPU leased twice. WAL with ``synchronous=NORMAL`` survives a crash of the process;
a power cut may lose the last changes but never corrupts the file.

Tokens are stored only as SHA-256 hashes. The model an admin names for an app when issuing its
token is kept too (``models``): its placement slowdowns, which a measured rank applies (D21). So is
the lottery's secret (D24, ``arbiter.lottery``): made once, never sent, so that a restarted arbiter
draws every round's numbers as the one before it would have.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from arbiter.leases import Lease
from arbiter.lottery import new_secret
from arbiter.rounds import AppRecord, EngineState

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS apps (
    app TEXT PRIMARY KEY, arrived REAL NOT NULL, contention_at_arrival REAL NOT NULL,
    attained REAL NOT NULL, demand INTEGER, last_rho REAL, most INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS leases (
    gpu TEXT PRIMARY KEY, app TEXT NOT NULL, granted_at REAL NOT NULL, expires_at REAL NOT NULL,
    round_id INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS tokens (
    hash TEXT PRIMARY KEY, app TEXT NOT NULL, kind TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS rounds (round_id INTEGER PRIMARY KEY, now REAL NOT NULL, summary TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS models (app TEXT PRIMARY KEY, model TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS viewers (hash TEXT PRIMARY KEY, name TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS departed (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, app TEXT NOT NULL, arrived REAL NOT NULL, left REAL NOT NULL,
    why TEXT NOT NULL, last_rho REAL, gpu_seconds REAL NOT NULL
);
"""
SCHEMA_VERSION = "1"
ROUNDS_KEPT = 10_000
DEPARTED_KEPT = 1_000  # the latest apps that left, for ``status`` (issue 36)


class StoreError(RuntimeError):
    """A journal that cannot be used (wrong schema version, another cluster's journal, ...)."""


def lock_journal(path: str | Path) -> int | None:
    """Take the journal for this process: an exclusive lock on ``<journal>.lock`` holding our pid,
    returned as a file descriptor to close when the arbiter stops (the kernel drops it if the
    process dies). Two arbiters on one journal would overwrite each other's rounds and leases, so a
    second one is refused, naming the first; an in-memory journal needs no lock (None)."""
    if str(path) == ":memory:":
        return None
    lock = Path(f"{path}.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open the journal's lock file {lock}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreError(f"the journal {path} is in use by another arbiter (pid {holder}); "
                         "stop it first, or give this one its own --db") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _num(x: float | None) -> float | None:
    """JSON and SQLite have no infinity; rho may be infinite (D7)."""
    return None if x is None or math.isinf(x) else x


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # Exclusive before WAL: SQLite then keeps the WAL index in the process's heap instead of a
            # memory-mapped -shm file. A mapped file the process cannot write (made read-only or
            # immutable under it, or on a full disk) faults on the next write with SIGBUS, which
            # killed the arbiter without a word; a write that fails now raises, and the service
            # refuses mutations and turns NOT_SERVING. Only the arbiter opens its journal (the
            # journal's lock file says so), so nothing else needs the shared index.
            self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA busy_timeout=5000")
            self.db.executescript(SCHEMA)
            columns = {row[1] for row in self.db.execute("PRAGMA table_info(apps)")}
            if "most" not in columns:  # a journal from before D28: the column comes with its default
                self.db.execute("ALTER TABLE apps ADD COLUMN most INTEGER NOT NULL DEFAULT 0")
        except sqlite3.Error as exc:
            raise StoreError(f"{self.path}: cannot use it as the journal: {exc}") from None
        self._inode = os.stat(self.path).st_ino
        #: token hashes revoked in memory whose deletion the journal could not write yet: refused
        #: all the same, and deleted when a write succeeds again (:meth:`flush`)
        self._revoked: dict[str, str] = {}
        self._revoked_viewers: set[str] = set()  # viewer token hashes whose deletion is not written yet
        version = self._meta("schema_version")
        if version is None:
            self.db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        elif version != SCHEMA_VERSION:
            raise StoreError(f"{self.path}: journal schema {version}, this arbiter writes {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()

    def _cause(self, exc: BaseException) -> str:
        """What went wrong with a write, in words an operator can act on: SQLite says "disk I/O
        error" for a read-only or immutable file and for a full disk alike."""
        where = f"the journal {self.path} cannot be written"
        try:
            free = shutil.disk_usage(self.path.parent).free
        except OSError:
            free = None
        hint = ("the disk is full" if free is not None and free < (1 << 20)
                else "is the file (or its -wal) read-only or immutable?")
        return f"{where}: {exc} ({hint})"

    def _check_file(self) -> None:
        """A journal file removed or replaced under the arbiter would take every write into a file
        no restart reads: refused like a failed write."""
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            raise StoreError(f"the journal {self.path} was removed: nothing written now would survive a restart") from None
        if inode != self._inode:
            raise StoreError(f"the journal {self.path} was replaced by another file: nothing written now would "
                             "survive a restart")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Cursor]:
        """One write transaction; any failure is a :class:`StoreError` with its real cause, and
        nothing of it is kept (the rollback of a transaction SQLite already ended is not an error:
        it used to hide "disk full" behind "cannot rollback")."""
        self._check_file()
        cur = self.db.cursor()
        try:
            cur.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise StoreError(self._cause(exc)) from None
        try:
            yield cur
            cur.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                cur.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise StoreError(self._cause(exc)) from None
            raise

    def _meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def lottery_secret(self) -> bytes:
        """The secret every round's seed is derived from (D24): the journaled one, or a new one
        from the CSPRNG, journaled before it is returned (so no round is ever drawn from a secret
        a restart would not have)."""
        with self._transaction() as cur:
            row = cur.execute("SELECT value FROM meta WHERE key = 'lottery_secret'").fetchone()
            if row is None:
                secret = new_secret()
                cur.execute("INSERT INTO meta VALUES ('lottery_secret', ?)", (json.dumps(secret.hex()),))
            else:
                secret = bytes.fromhex(json.loads(row[0]))
        return secret

    # -- engine state ----------------------------------------------------------------------

    def bind_cluster(self, name: str) -> None:
        """Refuse a journal written for another cluster (its leases would name other GPUs)."""
        known = self._meta("cluster")
        if known is None:
            self.db.execute("INSERT INTO meta VALUES ('cluster', ?)", (name,))
        elif known != name:
            raise StoreError(f"{self.path}: this journal belongs to cluster {known!r}, not {name!r}")

    def save(
        self,
        state: EngineState,
        *,
        settings: Mapping[str, Any],
        rho: Mapping[str, float] | None = None,
        round_summary: Mapping[str, Any] | None = None,
        departed: Sequence[Mapping[str, Any]] = (),
    ) -> None:
        """Journal the engine's whole state (and a finished round, and the apps that left since the
        last write: ``app, arrived, left, why, last_rho, gpu_seconds``) in one transaction."""
        meta = {
            "clock": state.clock,
            "contention": state.contention,
            "round_id": state.round_id,
            "pending_since": state.pending_since,
            "drained": sorted(state.drained),
            "added_machines": [list(m) for m in state.added_machines],
            "idle": sorted(state.idle),
            "waiting": sorted(state.waiting),  # D33
            "settings": dict(settings),
        }
        with self._transaction() as cur:
            cur.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", [(k, json.dumps(v)) for k, v in meta.items()])
            old_rho = dict(cur.execute("SELECT app, last_rho FROM apps").fetchall())
            cur.execute("DELETE FROM apps")
            cur.executemany(
                "INSERT INTO apps (app, arrived, contention_at_arrival, attained, demand, last_rho, most) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (a, r.arrived, r.contention_at_arrival, r.attained, r.demand,
                     _num((rho or {}).get(a, old_rho.get(a))), r.most)
                    for a, r in state.apps.items()
                ],
            )
            cur.execute("DELETE FROM leases")
            cur.executemany(
                "INSERT INTO leases VALUES (?, ?, ?, ?, ?)",
                [(x.gpu, x.app, x.granted_at, x.expires_at, x.round_id) for x in state.leases],
            )
            if round_summary is not None:
                cur.execute(
                    "INSERT OR REPLACE INTO rounds VALUES (?, ?, ?)",
                    (round_summary["round_id"], round_summary["now"], json.dumps(round_summary)),
                )
                cur.execute("DELETE FROM rounds WHERE round_id <= ?", (round_summary["round_id"] - ROUNDS_KEPT,))
            if departed:
                cur.executemany(
                    "INSERT INTO departed (app, arrived, left, why, last_rho, gpu_seconds) VALUES (?, ?, ?, ?, ?, ?)",
                    [(d["app"], d["arrived"], d["left"], d["why"], _num(d["last_rho"]), d["gpu_seconds"])
                     for d in departed])
                cur.execute("DELETE FROM departed WHERE seq <= (SELECT MAX(seq) FROM departed) - ?", (DEPARTED_KEPT,))

    def departed(self, limit: int = 20) -> list[dict[str, Any]]:
        """The latest apps that left, newest first."""
        rows = self.db.execute("SELECT app, arrived, left, why, last_rho, gpu_seconds FROM departed "
                               "ORDER BY seq DESC LIMIT ?", (limit,))
        return [{"app": a, "arrived": arrived, "left": left, "why": why,
                 "last_rho": math.inf if rho is None else rho, "gpu_seconds": gpu_s}
                for a, arrived, left, why, rho, gpu_s in rows]

    def load(self) -> tuple[EngineState, dict[str, Any]] | None:
        """The journaled state and settings, or None for a new journal."""
        raw = self._meta("round_id")
        if raw is None:
            return None
        meta = {k: json.loads(v) for k, v in self.db.execute("SELECT key, value FROM meta")
                if k not in ("schema_version", "cluster", "lottery_secret")}
        apps = {
            a: AppRecord(arrived, c0, attained, demand, most)
            for a, arrived, c0, attained, demand, most in self.db.execute(
                "SELECT app, arrived, contention_at_arrival, attained, demand, most FROM apps ORDER BY app")
        }
        leases = tuple(Lease(*row) for row in self.db.execute("SELECT * FROM leases ORDER BY gpu"))
        state = EngineState(
            clock=meta["clock"],
            contention=meta["contention"],
            round_id=meta["round_id"],
            pending_since=meta["pending_since"],
            apps=apps,
            leases=leases,
            drained=frozenset(meta.get("drained", ())),
            added_machines=tuple(tuple(m) for m in meta.get("added_machines", ())),
            idle=frozenset(meta.get("idle", ())),
            waiting=frozenset(meta.get("waiting", ())),
        )
        return state, meta.get("settings", {})

    def last_rho(self) -> dict[str, float]:
        return {a: (math.inf if r is None else r) for a, r in self.db.execute("SELECT app, last_rho FROM apps")}

    def rounds(self, limit: int = 50) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT summary FROM rounds ORDER BY round_id DESC LIMIT ?", (limit,))
        return [json.loads(s) for (s,) in rows]

    # -- tokens ----------------------------------------------------------------------------

    def add_token(self, token: str, app: str, kind: str) -> None:
        with self._transaction() as cur:
            cur.execute("INSERT INTO tokens VALUES (?, ?, ?, ?)", (token_hash(token), app, kind, time.time()))

    def token_app(self, token: str, kind: str) -> str | None:
        digest = token_hash(token)
        if digest in self._revoked:
            return None
        row = self.db.execute("SELECT app FROM tokens WHERE hash = ? AND kind = ?", (digest, kind)).fetchone()
        return row[0] if row else None

    def exchange_token(self, registration: str, credential: str, app: str) -> bool:
        """Use up a registration token and store the credential it buys, in one transaction (a
        failure must not consume the token without issuing the credential). The app's older
        credentials are revoked with it (issue 12: re-registering revokes the old credential).
        False if the token was used meanwhile."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM tokens WHERE hash = ? AND kind = 'registration' AND app = ?",
                        (token_hash(registration), app))
            if cur.rowcount != 1:
                return False  # nothing was changed: the commit writes nothing
            cur.execute("DELETE FROM tokens WHERE app = ? AND kind = 'credential'", (app,))
            cur.execute("INSERT INTO tokens VALUES (?, ?, ?, ?)", (token_hash(credential), app, "credential", time.time()))
        return True

    def revoke(self, app: str) -> int:
        """Every credential and unused registration token of ``app``; returns how many. Fails
        closed: when the deletion cannot be written, the tokens are refused from now on all the
        same (:meth:`token_app`), the deletion is tried again at the next :meth:`flush`, and the
        :class:`StoreError` says that it is not durable yet."""
        hashes = [h for (h,) in self.db.execute("SELECT hash FROM tokens WHERE app = ?", (app,))]
        for digest in hashes:
            self._revoked[digest] = app
        try:
            with self._transaction() as cur:
                count = cur.execute("DELETE FROM tokens WHERE app = ?", (app,)).rowcount
        except StoreError as exc:
            raise StoreError(f"{exc}; the app's {len(hashes)} token(s) are refused from now on, but a "
                             "restart before the journal can be written would accept them again") from None
        for digest in hashes:
            self._revoked.pop(digest, None)
        return count

    def flush(self) -> None:
        """Write the revocations the journal could not write before (a no-op when there are none)."""
        for app in sorted(set(self._revoked.values())):
            self.revoke(app)

    @property
    def unwritten(self) -> int:
        """Tokens revoked in memory only (what a restart now would lose)."""
        return len(self._revoked)

    def registered(self, app: str) -> bool:
        """Whether ``app`` holds a credential or an unused registration token."""
        return self.db.execute("SELECT 1 FROM tokens WHERE app = ? LIMIT 1", (app,)).fetchone() is not None

    def token_apps(self) -> set[str]:
        """Apps with a credential or an unused registration token."""
        return {app for (app,) in self.db.execute("SELECT DISTINCT app FROM tokens")}

    # -- models (D21) -----------------------------------------------------------------------

    def bind_model(self, app: str, model: str) -> None:
        """The app's model, as an admin named it when issuing its token: its placement slowdowns."""
        with self._transaction() as cur:
            cur.execute("INSERT OR REPLACE INTO models VALUES (?, ?)", (app, model))

    def unbind_model(self, app: str) -> None:
        """The app leaves for good (RemoveApp): a later app of the same name starts unbound."""
        with self._transaction() as cur:
            cur.execute("DELETE FROM models WHERE app = ?", (app,))

    def models(self) -> dict[str, str]:
        """App -> model for every app an admin bound to one."""
        return dict(self.db.execute("SELECT app, model FROM models"))

    # -- viewer tokens (the dashboard) -------------------------------------------------------

    def add_viewer(self, token: str, name: str) -> None:
        """A token that lets ``name`` read the dashboard off loopback (and nothing else): kept apart
        from the apps' tokens, so a viewer is never counted, registered or revoked as an app."""
        with self._transaction() as cur:
            cur.execute("INSERT INTO viewers VALUES (?, ?, ?)", (token_hash(token), name, time.time()))

    def viewer(self, token: str) -> str | None:
        """The viewer a token was issued to, or None (unknown or revoked)."""
        digest = token_hash(token)
        if digest in self._revoked_viewers:
            return None
        row = self.db.execute("SELECT name FROM viewers WHERE hash = ?", (digest,)).fetchone()
        return row[0] if row else None

    def revoke_viewer(self, name: str) -> int:
        """Every viewer token of ``name``; returns how many. Refused from now on even when the
        deletion cannot be written (then the StoreError says a restart would accept them again)."""
        hashes = [h for (h,) in self.db.execute("SELECT hash FROM viewers WHERE name = ?", (name,))]
        self._revoked_viewers.update(hashes)
        try:
            with self._transaction() as cur:
                count = cur.execute("DELETE FROM viewers WHERE name = ?", (name,)).rowcount
        except StoreError as exc:
            raise StoreError(f"{exc}; the viewer's {len(hashes)} token(s) are refused from now on, but a "
                             "restart before the journal can be written would accept them again") from None
        self._revoked_viewers.difference_update(hashes)
        return count

    def viewers(self) -> list[str]:
        """The names holding viewer tokens."""
        return [name for (name,) in self.db.execute("SELECT DISTINCT name FROM viewers ORDER BY name")]

    def open_tokens(self, app: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM tokens WHERE app = ? AND kind = 'registration'",
                               (app,)).fetchone()[0]
