"""A run's and a session's last ops as a Chrome/Perfetto trace: the file checked against a JSON schema of the Trace
Event Format's JSON object form (the fields it defines for complete and metadata events), the three phases of each op
nested inside it and back to back, one track never holding overlapping ops, the sizes in the args, and the ring
keeping only the newest ops."""

from __future__ import annotations

import httpx
import jsonschema
import pytest

import pytrio_compat as trio

from .operator_support import ADMIN, TENANT_KEY, operator_worker

# The Trace Event Format (its JSON Object Format): {"traceEvents": [...], "displayTimeUnit": "ms" | "ns"}; a complete
# event has name, cat, ph "X", ts and dur (microseconds), pid, tid, args; a metadata event ph "M" names a process or
# thread in args.name.
TRACE_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {"type": "array", "items": {"oneOf": [
            {"type": "object", "required": ["name", "cat", "ph", "ts", "dur", "pid", "tid", "args"],
             "properties": {"name": {"type": "string"}, "cat": {"type": "string"}, "ph": {"const": "X"},
                            "ts": {"type": "integer", "minimum": 0}, "dur": {"type": "integer", "minimum": 0},
                            "pid": {"type": "integer"}, "tid": {"type": "integer"}, "args": {"type": "object"}}},
            {"type": "object", "required": ["name", "ph", "pid", "args"],
             "properties": {"name": {"enum": ["process_name", "thread_name"]}, "ph": {"const": "M"},
                            "pid": {"type": "integer"}, "tid": {"type": "integer"},
                            "args": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"}}}}},
        ]}},
    },
}
PHASES = ("queue", "run", "encode")


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    with operator_worker(tiny_model_dir, tmp_path_factory.mktemp("traces") / "storage",
                         model_name=str(tiny_model_dir)) as running:
        yield running


def _datum(first: int, n: int) -> trio.Datum:
    ids = list(range(first, first + n + 1))
    return trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})


def fetch(worker, path: str) -> dict:
    answer = httpx.get(worker.url + path, headers=ADMIN, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-disposition"].startswith("attachment; filename=\"trace-")
    trace = answer.json()
    jsonschema.validate(trace, TRACE_SCHEMA)
    return trace


def ops_of(trace: dict) -> list[dict]:
    """Each op with its phases, checked: the phases nest inside the op, back to back, on the op's track."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ops = [e for e in spans if e["cat"] == "op"]
    out = []
    for op in ops:
        rid = op["args"]["request_id"]
        phases = {e["cat"]: e for e in spans if e["cat"] != "op" and e["args"]["request_id"] == rid}
        assert sorted(phases) == sorted(PHASES)
        cursor = op["ts"]
        for name in PHASES:
            phase = phases[name]
            assert phase["tid"] == op["tid"] and phase["pid"] == op["pid"]
            assert phase["ts"] == cursor, (name, phase, op)
            cursor = phase["ts"] + phase["dur"]
        assert cursor == op["ts"] + op["dur"]
        out.append({**op, "phases": phases})
    for tid in {op["tid"] for op in ops}:  # a track's ops never overlap, so its slices always nest
        track = sorted((o for o in ops if o["tid"] == tid), key=lambda o: o["ts"])
        for before, after in zip(track, track[1:]):
            assert before["ts"] + before["dur"] <= after["ts"]
    named = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {op["tid"] for op in ops} <= named
    return out


def test_a_runs_trace_has_its_ops_in_order_with_nested_phases_and_sizes(worker):
    client = trio.ServiceClient(base_url=worker.url, api_key=TENANT_KEY)
    tc = client.create_lora_training_client(next(iter(worker.service.models.sources)), rank=4)
    futures = [tc.forward_backward([_datum(10, 6), _datum(30, 9)]), tc.optim_step(trio.AdamParams(learning_rate=1e-3)),
               tc.forward_backward([_datum(50, 4)])]  # queued together: the second waits while the first runs
    for future in futures:
        future.result()
    ops = ops_of(fetch(worker, f"/operator/traces/scope/{tc.training_run_id}"))
    assert [op["name"] for op in ops] == ["forward_backward", "optim_step", "forward_backward"]
    assert [op["ts"] for op in ops] == sorted(op["ts"] for op in ops)
    first, step, last = ops
    assert (first["args"]["tokens"], first["args"]["rows"]) == (15, 2)
    assert (last["args"]["tokens"], last["args"]["rows"]) == (4, 1) and step["args"]["tokens"] == 0
    assert all(op["args"]["status"] == "succeeded" and op["args"]["result_bytes"] > 0 for op in ops)
    assert first["phases"]["run"]["args"]["tokens"] == 15
    client.close()


def test_the_ring_keeps_only_the_newest_ops(worker):
    book = worker.service.usage.traces
    book.per_scope = 3  # rings made from now on
    try:
        client = trio.ServiceClient(base_url=worker.url, api_key=TENANT_KEY)
        tc = client.create_lora_training_client(next(iter(worker.service.models.sources)), rank=4)
        for n in range(1, 6):
            tc.forward_backward([_datum(10, n)]).result()
        ops = ops_of(fetch(worker, f"/operator/traces/scope/{tc.training_run_id}"))
        assert [op["args"]["tokens"] for op in ops] == [3, 4, 5]  # the last three of five
        client.close()
    finally:
        book.per_scope = 256


def test_a_tinker_sessions_trace_holds_its_models_ops(worker, tiny_model_dir):
    from tinker_raw_client import RawTinker

    raw = RawTinker(worker.url, "tml-" + TENANT_KEY)
    model_id = raw.model(str(tiny_model_dir))
    raw.run_forward(model_id, 1)
    raw.run_forward(model_id, 2)
    session = model_id.split(":train:")[0]
    ops = ops_of(fetch(worker, f"/operator/traces/session/{session}"))
    assert [op["name"] for op in ops] == ["forward_backward", "forward_backward"]
    assert httpx.get(worker.url + "/operator/traces/session/sess-unknown", headers=ADMIN).status_code == 404
    assert httpx.get(worker.url + "/operator/traces/scope/run-unknown", headers=ADMIN).status_code == 404
    raw.close()
