"""The lease table never lets two apps hold one GPU (D10)."""

import pytest

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
