"""The lease table never lets two apps hold one GPU (D10)."""

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.leases import LeaseConflict, LeaseTable


def test_grant_expire_release():
    t = LeaseTable()
    t.grant("a", ["g1", "g2"], now=0, expires_at=10, round_id=1)
    assert t.held_by("a") == {"g1", "g2"} and t.holder("g1") == "a"
    assert t.next_expiry() == 10
    with pytest.raises(LeaseConflict, match="already leased to \\['a'\\]"):
        t.grant("b", ["g2", "g3"], now=1, expires_at=11, round_id=2)
    assert t.holder("g3") is None  # all or nothing
    with pytest.raises(LeaseConflict, match="does not hold"):
        t.release("b", ["g1"])
    assert [lease.gpu for lease in t.expire(9.9)] == []
    assert sorted(lease.gpu for lease in t.expire(10)) == ["g1", "g2"]
    assert len(t) == 0
    t.grant("b", ["g1"], now=10, expires_at=20, round_id=3)
    assert t.release("b") == {"g1"} and t.held_by("b") == frozenset()


def test_lease_must_end_after_it_starts():
    with pytest.raises(ValueError):
        LeaseTable().grant("a", ["g"], now=5, expires_at=5, round_id=1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "release", "release_all", "expire", "restore"]),
                          st.sampled_from("abc"), st.sets(st.sampled_from([f"g{k}" for k in range(6)]), max_size=3),
                          st.integers(1, 6)), max_size=40))
def test_held_by_always_matches_the_holders_of_the_gpus(ops):
    """``held_by`` keeps its answers between changes; every grant, release, expiry and restore
    must drop them, or a round would offer or split GPUs an app no longer holds."""
    t = LeaseTable()
    now, expired = 0, []
    for op, app, gpus, step in ops:
        for other in "abc":
            t.held_by(other)  # fill the kept answers before each change
        if op == "grant":
            with contextlib.suppress(LeaseConflict):
                t.grant(app, gpus, now=now, expires_at=now + step, round_id=1)
        elif op == "release":
            with contextlib.suppress(LeaseConflict):
                t.release(app, gpus)
        elif op == "release_all":
            t.release(app)
        elif op == "expire":
            now += step
            expired = t.expire(now)
        elif expired:
            lease = expired.pop()
            if t.holder(lease.gpu) is None:
                t.restore(lease)
        for other in "abc":
            assert t.held_by(other) == {g for g in (f"g{k}" for k in range(6)) if t.holder(g) == other}
