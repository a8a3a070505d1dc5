#!/usr/bin/env bash
# Regenerates server_mock/api/tinker/proto/tinker_wire_pb2.py from server_mock/api/tinker/proto/tinker_wire.proto.
# Needs grpcio-tools (in the dev extra). The generated file is committed; tests/tinker/test_tinker_schema.py
# checks that it matches a fresh regeneration.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${1:-server_mock/api/tinker/proto}"
"$PYTHON" -m grpc_tools.protoc -I server_mock/api/tinker/proto --python_out="$OUT" server_mock/api/tinker/proto/tinker_wire.proto
