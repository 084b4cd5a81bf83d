"""Regenerate the gRPC stubs from kvstore/proto/kvstore.proto.

    python scripts/gen_proto.py           # write kvstore/proto/kvstore_pb2*.py
    python scripts/gen_proto.py --check   # exit 1 if the committed stubs are stale

tests/test_proto.py runs the check, so a proto edit without regenerated stubs fails CI.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "kvstore" / "proto"
OUTPUTS = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "kvstore.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # protoc writes `import kvstore_pb2`; make it a package-relative import.
    grpc_file = out_dir / "kvstore_pb2_grpc.py"
    text = grpc_file.read_text().replace("import kvstore_pb2 as kvstore__pb2",
                                         "from kvstore.proto import kvstore_pb2 as kvstore__pb2")
    grpc_file.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        generate(PROTO_DIR)
        print(f"wrote {', '.join(OUTPUTS)} in {PROTO_DIR}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [name for name in OUTPUTS
                 if (Path(tmp) / name).read_text() != (PROTO_DIR / name).read_text()]
    if stale:
        print(f"stale gRPC stubs: {', '.join(stale)}; run: python scripts/gen_proto.py", file=sys.stderr)
        return 1
    print("gRPC stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
