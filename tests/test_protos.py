"""The committed gRPC modules are exactly what grpcio-tools makes of protos/themis.proto.

The stubs are committed (installing the project needs no protoc); this test regenerates them with
the pinned grpcio-tools and fails if anyone edited the .proto without running
``python scripts/gen_protos.py``, or edited a generated file by hand.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_the_proto(tmp_path):
    gen = _generator()
    fresh = gen.generate(tmp_path)
    assert set(fresh) == set(gen.OUTPUTS)
    for name, text in fresh.items():
        committed = (ROOT / "protos" / name).read_text()
        assert committed == text, f"protos/{name} drifted from protos/themis.proto: run scripts/gen_protos.py"


def test_the_package_is_versioned():
    from protos import themis_pb2

    assert themis_pb2.DESCRIPTOR.package == "themis.v1"
    assert "Arbiter" in themis_pb2.DESCRIPTOR.services_by_name


def test_a_rho_request_carries_its_neighbourhood():
    """D43: the held GPUs' neighbourhood survives the wire by machine, as an offer's does; a request
    from an arbiter that models no contention has none."""
    from protos import wire
    from protos.messages import Neighbour, RhoRequest

    sent = RhoRequest(4, "a", 10.0, 2.0, 8, {"g0": ("r0", "m0", "s0"), "g1": ("r0", "m1", "s0")},
                      frozenset({"work"}), "c0ffee", {"m0": (Neighbour("MoE", 8, 4),), "m1": (Neighbour("FSDP", 4, 2),)})
    assert wire.rho_request(wire.rho_request_pb(sent, deadline=20.0), "a") == sent
    plain = RhoRequest(4, "a", 10.0, 2.0, 8, {"g0": ("r0", "m0", "s0")})
    assert wire.rho_request(wire.rho_request_pb(plain, deadline=20.0), "a").neighbourhood == {}


def test_an_offer_carries_its_neighbourhood_and_refuses_a_job_that_cannot_be():
    """The offer's neighbours (D35) survive the wire by machine; a neighbour with no class or no
    GPUs is refused with which entry and why."""
    import pytest

    from protos import themis_pb2 as pb
    from protos import wire
    from protos.messages import Neighbour, Offer

    sent = Offer(3, {"g0": ("r0", "m0", "s0")}, 10.0, 2.0, 8,
                 neighbourhood={"m0": (Neighbour("MoE", 8, 4), Neighbour("GraphSage", 2, 2)),
                                "m1": (Neighbour("MoE", 8, 4),)})
    assert wire.offer(wire.offer_pb(sent)) == sent
    bad = wire.offer_pb(sent)
    bad.neighbours.append(pb.Neighbour(machine="m2", cls="MoE", gpus=0, machines=1))
    with pytest.raises(wire.WireError, match=r"neighbour 3 on 'm2': gpus and machines must be >= 1"):
        wire.offer(bad)
    bad.neighbours[3].gpus, bad.neighbours[3].cls = 1, ""
    with pytest.raises(wire.WireError, match="neighbour 3: machine and class must be non-empty"):
        wire.offer(bad)
