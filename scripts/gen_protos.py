"""Generate the gRPC modules from protos/themis.proto (grpcio-tools, pinned in the test extra).

The generated modules are committed, so installing and running the project needs no protoc;
``tests/test_protos.py`` regenerates them into a temporary folder and fails if the committed ones
drift from the .proto. Run ``python scripts/gen_protos.py`` after editing the .proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "protos" / "themis.proto"
OUTPUTS = ("themis_pb2.py", "themis_pb2.pyi", "themis_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    """Run protoc on themis.proto into ``out``; return {file name: text} with the package import
    made absolute (protoc writes ``import themis_pb2``, which only works from inside protos/)."""
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO.parent}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
            str(PROTO)]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {PROTO}")
    texts = {}
    for name in OUTPUTS:
        text = (out / name).read_text()
        texts[name] = text.replace("import themis_pb2 as themis__pb2", "from protos import themis_pb2 as themis__pb2")
    return texts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (ROOT / "protos" / name).write_text(text)
            print(f"wrote protos/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
