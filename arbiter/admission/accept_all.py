"""Accept all (Blox's ``AcceptAll``): every app is admitted as it arrives. The default, and what
the engine did before admission policies existed (D33): with it no app ever waits, so every
published figure is unchanged."""

from __future__ import annotations

from collections.abc import Sequence

from arbiter.admission.base import AdmissionContext, AdmissionPolicy, WaitingApp


class AcceptAll(AdmissionPolicy):
    name = "accept-all"

    def admit(self, waiting: Sequence[WaitingApp], ctx: AdmissionContext) -> list[str]:
        return [w.app for w in waiting]
