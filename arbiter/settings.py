"""What an admin may change on a running arbiter: the service's settings, journaled with the state.

One place for them: ``serve``'s flags fill them (``arbiter.server``), ``UpdateSettings`` changes
them (``arbiter.admin``), agents are told them in their Welcome, and the round engine is set from
them (:meth:`Settings.apply_to`) -- each from the next round on, so a round never changes policy
between its offer and its allocation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arbiter.policies import POLICIES, make_policy
from arbiter.rank import check_rank
from arbiter.rounds import EXPIRY_WINDOW_SHARE, RoundEngine
from protos import themis_pb2 as pb

MAX_CONTENDERS = 4096  # the largest cap an admin may set (D20); 0 means none


@dataclass
class Settings:
    """What an admin may change on a running arbiter (journaled with the state)."""

    policy: str = "themis"
    fairness_knob: float = 0.8
    lease_s: float = 600.0
    coalesce_s: float = 1.0
    expiry_window_s: float | None = None
    report_timeout_s: float = 2.0
    bid_timeout_s: float = 2.0
    heartbeat_s: float = 10.0
    # D20: bidders the auction takes per round, worst first (0 = no cap). The exact auction's work
    # grows steeply with them: 16 keep a 256-GPU mass expiry near 1 s, 98 took 438 s (D20).
    max_contenders: int = 16
    # D21: "measured" ranks an app bound to a model (IssueToken) by its claimed work at that model's
    # slowdowns (apps bound to none by their report); "reported" ranks every app by its report.
    rank: str = "measured"
    # D27: a round ends the leases an app holds beyond its fair share while an app that holds nothing
    # waits (once per such app); False lets every lease run to its end.
    reclaim: bool = True
    # D41: the least number of the ranked apps a Themis auction takes; 1 is D6 as the paper has it,
    # 2 leaves no auction with a single bidder (an option, measured in docs/mechanism.md).
    min_bidders: int = 1
    # An app with no agent connected and no lease for this long goes idle: it counts in no one's
    # N_avg (D5) and is not asked for rho until its agent comes back. None: a lease and a minute.
    idle_s: float | None = None

    def idle_after(self) -> float:
        return self.idle_s if self.idle_s is not None else self.lease_s + 60.0

    def check(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
        if not 0 <= self.fairness_knob < 1:
            raise ValueError(f"fairness knob f must be in [0, 1), got {self.fairness_knob}")
        for name in ("lease_s", "report_timeout_s", "bid_timeout_s", "heartbeat_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not self.coalesce_s >= 0:
            raise ValueError(f"coalesce_s must be >= 0, got {self.coalesce_s}")
        if isinstance(self.max_contenders, bool) or not isinstance(self.max_contenders, int) \
                or not 0 <= self.max_contenders <= MAX_CONTENDERS:
            raise ValueError(f"max_contenders must be an integer from 0 (no cap) to {MAX_CONTENDERS}, "
                             f"got {self.max_contenders!r}")
        check_rank(self.rank)
        if isinstance(self.min_bidders, bool) or not isinstance(self.min_bidders, int) \
                or not 1 <= self.min_bidders <= MAX_CONTENDERS:
            raise ValueError(f"min_bidders must be an integer from 1 to {MAX_CONTENDERS}, got {self.min_bidders!r}")
        if not isinstance(self.reclaim, bool):
            raise ValueError(f"reclaim must be true or false, got {self.reclaim!r}")
        if self.idle_s is not None and not (self.idle_s > 0 and math.isfinite(self.idle_s)):
            raise ValueError(f"idle_s must be a positive number of seconds, got {self.idle_s}")

    def policy_object(self):
        # D39: the service reports a winner's c_i as bounds where its lottery did not need the
        # exact value (the grants are the same; the round's auction is about half the CPU); D40: it
        # keeps the first optimal PF allocation found (no run of the service repeats anyway)
        options = ({"fairness_knob": self.fairness_knob, "max_contenders": self.max_contenders or None,
                    "exact_payments": False, "canonical": False, "min_bidders": self.min_bidders}
                   if self.policy == "themis" else {})
        return make_policy(self.policy, **options)

    def apply_to(self, engine: RoundEngine) -> None:
        """Set the engine from these settings: they take effect from its next round; leases
        already granted keep their expiry."""
        engine.policy = self.policy_object()
        engine.rank = self.rank
        engine.reclaim = self.reclaim
        engine.lease_s = self.lease_s
        window = self.expiry_window_s if self.expiry_window_s is not None else self.lease_s * EXPIRY_WINDOW_SHARE
        engine.expiry_window_s = max(self.coalesce_s, window)

    def to_pb(self, expiry_window_s: float) -> pb.Settings:
        """As agents (Welcome) and admins (GetClusterState, UpdateSettings) are told them, with the
        expiry window the engine applies."""
        return pb.Settings(policy=self.policy, fairness_knob=self.fairness_knob, lease_s=self.lease_s,
                           coalesce_s=self.coalesce_s, expiry_window_s=expiry_window_s,
                           report_timeout_s=self.report_timeout_s, bid_timeout_s=self.bid_timeout_s,
                           max_contenders=self.max_contenders, rank=self.rank, reclaim=self.reclaim,
                           min_bidders=self.min_bidders)
