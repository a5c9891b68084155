"""Admission policies, selectable by name (Blox's admission block in front of any scheduling
policy; D33): ``accept-all`` (the default) and ``fifo:THRESHOLD``.

``make_admission("fifo:1.2")`` builds one from the text an operator or a simulation gives
(``themis-arbiter serve --admission``, ``themis-sim --admission``): a name, then optionally ``:``
and the policy's one argument.
"""

from __future__ import annotations

from arbiter.admission.accept_all import AcceptAll
from arbiter.admission.base import AdmissionContext, AdmissionPolicy, WaitingApp
from arbiter.admission.fifo import FifoAdmission

DEFAULT_ADMISSION = "accept-all"
ADMISSIONS: dict[str, type[AdmissionPolicy]] = {cls.name: cls for cls in (AcceptAll, FifoAdmission)}


def make_admission(text: str | None = None) -> AdmissionPolicy:
    """The admission policy ``NAME[:ARG]`` names (None or "": the default, accept-all)."""
    text = (text or DEFAULT_ADMISSION).strip()
    name, _, arg = text.partition(":")
    cls = ADMISSIONS.get(name.strip())
    if cls is None:
        raise ValueError(f"unknown admission policy {name!r} in {text!r}; choose one of "
                         f"{', '.join(sorted(ADMISSIONS))} (e.g. fifo:1.2)")
    if not arg.strip():
        return cls()
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"admission {text!r}: the argument after ':' must be a number, got {arg!r}") from None
    try:
        return cls(value)
    except TypeError:
        raise ValueError(f"admission {text!r}: {name} takes no argument") from None


__all__ = ["ADMISSIONS", "DEFAULT_ADMISSION", "AcceptAll", "AdmissionContext", "AdmissionPolicy", "FifoAdmission",
           "WaitingApp", "make_admission"]
