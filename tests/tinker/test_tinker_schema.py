"""The committed generated module matches the committed .proto, and our schema is wire-compatible with
the official client's (field by field, in both directions)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "server_mock" / "api" / "tinker" / "proto"


def test_generated_module_matches_a_fresh_regeneration(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (it is in the dev extra)")
    result = subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)],
                            env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    fresh = (tmp_path / "tinker_wire_pb2.py").read_text()
    committed = (PROTO_DIR / "tinker_wire_pb2.py").read_text()
    assert fresh == committed, "server_mock/api/tinker/proto/tinker_wire_pb2.py is stale: run scripts/gen_proto.sh"


def _fields(descriptor) -> dict[int, tuple[str, int, str | None]]:
    """Field number -> (name, wire-relevant type, message/enum type name without the package)."""
    out = {}
    for f in descriptor.fields:
        sub = f.message_type or f.enum_type
        out[f.number] = (f.name, f.type, sub.name if sub is not None else None)
    return out


@pytest.mark.parametrize("name", ["ForwardBackwardRequest", "Datum", "Chunk", "EncodedTextChunk", "Tensor",
                                  "SparseCsr", "LossConfigValue", "ForwardBackwardOutput", "ArrayRecord",
                                  "BatchedTensor", "SampleResponse", "SampledSequence", "TopkLogprobs"])
def test_our_messages_agree_with_the_official_schema(name):
    """Every field we declare has the official number, name and type (messages matched by their own
    field layout, since the official package may name nested types differently)."""
    from tinker.proto import tinker_public_pb2 as official

    from server_mock.api.tinker.proto import tinker_wire_pb2 as ours

    mine = _fields(ours.DESCRIPTOR.message_types_by_name[name])
    theirs = _fields(official.DESCRIPTOR.message_types_by_name[name])
    for number, (field_name, kind, _) in mine.items():
        assert number in theirs, f"{name}.{field_name} = {number} is not an official field"
        assert theirs[number][:2] == (field_name, kind), (name, number, theirs[number], mine[number])
