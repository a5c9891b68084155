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
