"""What an admission policy is (Blox, seeds/000, section 5.1: "the job admission policy acts as a
gate keeper for newly arriving jobs"; D33).

The round engine (``arbiter.rounds``) keeps every app from its arrival. An app that the admission
policy has not let in yet *waits*: it is not asked for rho, gets no offer and no grant, and no
lease is reclaimed for it (D27), but it counts in N_avg (D5) and its finish time counts from its
arrival, so waiting shows in its rho (D33). Each time something could change the answer (an app
arrives or says its demand, an app leaves, a round opens) the engine asks the policy which of the
waiting apps, in arrival order, go in now. A new admission rule is one file with one subclass,
registered by name in ``arbiter.admission``.

Not to be confused with D25's admission of bidders to the auction's partial-allocation step
(``arbiter.auction.admit``), which happens inside a round among apps already let in here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class WaitingApp:
    """An app waiting for admission: its name, when it arrived and the GPUs it has said it could
    use (None until it says)."""

    app: str
    arrived: float
    demand: int | None


@dataclass(frozen=True)
class AdmissionContext:
    """What an admission policy may look at: the cluster's GPUs (drained machines included: they
    come back) and the GPUs the admitted apps want in all (each its stated demand, D6)."""

    cluster_size: int
    admitted_demand: int
    admitted: int  # apps admitted (those gone quiet, the service's idle apps, left out)


class AdmissionPolicy(ABC):
    name: ClassVar[str]

    @abstractmethod
    def admit(self, waiting: Sequence[WaitingApp], ctx: AdmissionContext) -> list[str]:
        """Which of ``waiting`` (in arrival order) go in now."""

    def spec(self) -> str:
        """The text ``make_admission`` builds this policy from (``NAME[:ARG]``), for summaries."""
        return self.name
