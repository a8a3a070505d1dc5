"""The worker's Tinker protobuf codec (its own schema, the protobuf runtime) against the official SDK's
generated code, and the per-model seq_id gate. No worker process: these run in milliseconds."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from server_mock.api.tinker.gate import SeqGate
from server_mock.api.tinker.proto import decode, encode
from server_mock.api.tinker.router import tinker_message, tinker_metrics, to_tinker_path, to_trio_path
from server_mock.errors import WorkerError


def _official_request(loss_fn_config=None, seq_id=3) -> bytes:
    import torch

    datums = [
        types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 300]),
                    loss_fn_inputs={"target_tokens": [6, 7, 300, 2], "logprobs": [-1.0, -2.5, -0.25, -3.0],
                                    "advantages": [0.0, 1.5, -0.5, 2.0]}),
        types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                                         types.EncodedTextChunk(tokens=[70000])]),
                    # a 2-D torch weights tensor is sent as sparse CSR by the SDK
                    loss_fn_inputs={"target_tokens": np.array([2, 70000, 4], dtype=np.int64),
                                    "weights": torch.tensor([[0.0, 2.0], [0.0, 0.0], [1.5, 0.0]])}),
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="ppo", loss_fn_config=loss_fn_config),
        model_id="sess-x:train:0", seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_decodes_the_official_forward_backward_request():
    raw = _official_request({"clip_low_threshold": 0.75, "clip_high_threshold": 1.25, "loss_id": "abc"})
    req = decode.decode_forward_backward_request(raw)
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("sess-x:train:0", 3, "ppo", False)
    assert req.loss_fn_config == {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25, "loss_id": "abc"}
    first, second = req.data
    assert first.tokens.tolist() == [5, 6, 7, 300] and first.tokens.dtype == np.int64
    assert first.loss_fn_inputs["target_tokens"].dtype == np.int64
    np.testing.assert_array_equal(first.loss_fn_inputs["advantages"], np.float32([0.0, 1.5, -0.5, 2.0]))
    assert first.loss_fn_inputs["logprobs"].dtype == np.float32
    assert second.tokens.tolist() == [1, 2, 70000]  # chunks concatenated, int32 on the wire
    np.testing.assert_array_equal(second.loss_fn_inputs["weights"], [[0.0, 2.0], [0.0, 0.0], [1.5, 0.0]])


def test_numbers_only_config_and_negative_seq_id():
    raw = _official_request({"beta": 0.5}, seq_id=-7)
    req = decode.decode_forward_backward_request(raw)
    assert req.seq_id == -7 and req.loss_fn_config == {"beta": 0.5}
    assert decode.decode_forward_backward_request(_official_request(None)).loss_fn_config == {}


def test_malformed_bodies_are_rejected():
    raw = _official_request()
    with pytest.raises(decode.ProtoError):
        decode.decode_forward_backward_request(raw[:-3])
    with pytest.raises(decode.ProtoError):
        decode.decode_forward_backward_request(b"\x0f\x01")  # wire type 7
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    datum = msg.data.add()
    datum.model_input.add().image.data = b"png"
    with pytest.raises(decode.ProtoError, match="image"):
        decode.decode_forward_backward_request(msg.SerializeToString())


def test_forward_backward_output_decodes_in_the_official_client():
    outputs = [{"logprobs": np.float32([-1.0, -2.0, -3.0]), "elementwise_loss": np.float32([0.5, 0.0, 1.0])},
               {"logprobs": np.float32([-0.5]), "elementwise_loss": np.float32([2.0])},
               {"logprobs": np.zeros(0, np.float32), "elementwise_loss": np.zeros(0, np.float32)}]
    raw = encode.encode_forward_backward_output(outputs, {"loss:sum": 3.5, "token_count:sum": 4.0})
    out = deserialize_forward_backward_output(raw)
    assert out.loss_fn_output_type == "ArrayRecord"
    assert out.metrics == {"loss:sum": 3.5, "token_count:sum": 4.0}
    assert len(out.loss_fn_outputs) == 3
    for mine, theirs in zip(outputs, out.loss_fn_outputs):
        for key in mine:
            assert theirs[key].dtype == "float32"
            np.testing.assert_array_equal(theirs[key].to_numpy(), mine[key])


def test_sample_response_decodes_in_the_official_client():
    sequences = [{"stop_reason": "stop", "tokens": [4, 5, 6], "logprobs": [-0.1, -0.2, -0.3]},
                 {"stop_reason": "length", "tokens": [7], "logprobs": [-1.5]}]
    tops = [None, [(3, -0.5), (9, -1.25)], [(11, -0.75)]]
    raw = encode.encode_sample_response(sequences, [None, -2.0, -3.5], tops, 2)
    out = deserialize_sample_response(raw)
    assert [s.stop_reason for s in out.sequences] == ["stop", "length"]
    assert [s.tokens for s in out.sequences] == [[4, 5, 6], [7]]
    np.testing.assert_allclose(out.sequences[0].logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    assert out.prompt_logprobs == [None, -2.0, -3.5]
    assert out.topk_prompt_logprobs == [None, [(3, -0.5), (9, -1.25)], [(11, -0.75)]]


def test_metric_keys_paths_and_messages():
    metrics = tinker_metrics({"loss_sum": 2.0, "loss_mean": 0.5, "token_count": 4.0, "loss:sum": 2.0})
    assert metrics == {"loss:sum": 2.0, "token_count:sum": 4.0}
    assert all(key.count(":") == 1 for key in metrics)
    assert tinker_metrics({"loss_sum": 1.5}) == {"loss:sum": 1.5}
    assert to_trio_path("tinker://run-1/weights/a") == "trio://run-1/state/a"
    assert to_trio_path("tinker://run-1/sampler_weights/b.c") == "trio://run-1/sampler/b.c"
    assert to_tinker_path("trio://run-1/sampler/b.c") == "tinker://run-1/sampler_weights/b.c"
    for bad in ("tinker://run-1/weights", "trio://run-1/state/a", "tinker://run-1/external_weights/a"):
        with pytest.raises(WorkerError):
            to_trio_path(bad)
    assert tinker_message("path: path: no checkpoint at trio://run-9/state/x", "path") == \
        "path: no checkpoint at tinker://run-9/weights/x"


def _gate_harness(gate: SeqGate):
    """Admit requests whose 'work' records when it was handed over; failures are strings."""
    handed: list[int] = []
    futures: dict[str, object] = {}

    def admit(seq: int, digest: str = "d"):
        def submit():
            handed.append(seq)

            async def work():
                return seq

            return work()

        def add(work):
            rid = f"r{len(futures)}"
            futures[rid] = asyncio.ensure_future(work)
            return rid

        def fail(message):
            rid = f"f{len(futures)}"
            futures[rid] = message
            return rid

        return gate.admit(seq, digest, submit, add, fail)

    return admit, handed, futures


def test_seq_gate_orders_dedupes_and_skips_gaps():
    async def scenario():
        gate = SeqGate(gap_wait=0.2)
        admit, handed, futures = _gate_harness(gate)
        r3, r2 = admit(3), admit(2)  # parallel chunks: the first one comes last
        assert handed == [] and gate.next == 1
        r1 = admit(1)
        assert handed == [1, 2, 3] and gate.next == 4
        assert [await futures[r] for r in (r1, r2, r3)] == [1, 2, 3]
        assert admit(2) == r2 and handed == [1, 2, 3]  # a re-send: the same future, not run twice
        conflict = admit(2, digest="other")
        assert "different request" in futures[conflict]
        # a gap that never fills is given up on, then the late request fails readably
        r6 = admit(6)
        await asyncio.sleep(0.4)
        assert handed[-1] == 6 and await futures[r6] == 6
        assert "arrived after" in futures[admit(4)]

    asyncio.run(scenario())


def test_seq_gate_full_queue():
    async def scenario():
        gate = SeqGate(retry_after=0.05)
        room = {"free": 0}
        handed: list[int] = []
        tasks: dict[str, asyncio.Future] = {}

        def submitter(seq):
            def submit():
                if room["free"] == 0:
                    raise WorkerError(429, "too_many_queued_requests", "queue full")
                room["free"] -= 1
                handed.append(seq)

                async def work():
                    return seq

                return work()

            return submit

        def add(work):
            rid = f"r{len(tasks)}"
            tasks[rid] = asyncio.ensure_future(work)
            return rid

        # in order but the queue is full: turned away, nothing recorded; the client re-sends it later
        with pytest.raises(WorkerError):
            gate.admit(1, "d", submitter(1), add, str)
        assert gate.next == 1 and handed == []
        r2 = gate.admit(2, "d", submitter(2), add, str)  # held: seq_id 1 has not been taken yet
        room["free"] = 1
        r1 = gate.admit(1, "d", submitter(1), add, str)
        assert handed == [1] and gate.next == 2  # seq_id 2 waits for room, holding up the rest
        await asyncio.sleep(0.15)
        assert handed == [1]
        room["free"] = 1
        assert await asyncio.wait_for(tasks[r2], 2) == 2
        assert await tasks[r1] == 1 and handed == [1, 2] and gate.next == 3

    asyncio.run(scenario())


def test_seq_gate_keeps_the_slim_form_while_waiting():
    """A waiting request holds its smaller form (counted in HeldBytes), is prepared in a thread when its
    turn comes, in order; a failed preparation fails only its own future."""
    import threading

    from server_mock.api.tinker.holding import HeldBytes, Slim

    async def scenario():
        held = HeldBytes(per_session=100, per_worker=1000)
        gate = SeqGate(held=held, owner="s")
        handed, prepared_on = [], []
        futures: dict[str, asyncio.Future] = {}

        def submitter(seq):
            def submit():
                handed.append(seq)

                async def work():
                    return seq

                return work()

            return submit

        def slim(seq, size=10, broken=False):
            def prepare():
                prepared_on.append(threading.get_ident())
                if broken:
                    raise ValueError("cannot decode")
                return submitter(seq)

            return Slim(size, prepare)

        def add(work):
            rid = f"r{len(futures)}"
            futures[rid] = asyncio.ensure_future(work)
            return rid

        r3 = gate.admit(3, "d", submitter(3), add, str, 50, slim(3))
        r2 = gate.admit(2, "d", submitter(2), add, str, 50, slim(2, broken=True))
        r4 = gate.admit(4, "d", submitter(4), add, str, 50, slim(4, size=80))  # not smaller: kept as is
        assert held.by_session == {"s": 70} and handed == []
        with pytest.raises(WorkerError, match="max_waiting_bytes_per_session=100"):
            gate.admit(5, "d", submitter(5), add, str, 50)
        r1 = gate.admit(1, "d", submitter(1), add, str, 50, slim(1))  # in order: runs at once, as it is
        assert handed == [1]
        assert await asyncio.wait_for(futures[r4], 5) == 4
        assert handed == [1, 3, 4] and await futures[r3] == 3 and await futures[r1] == 1
        with pytest.raises(ValueError, match="cannot decode"):
            await futures[r2]
        assert len(prepared_on) == 2 and threading.get_ident() not in prepared_on
        assert held.total == 0 and held.by_session == {} and gate.next == 5

    asyncio.run(scenario())


@pytest.mark.parametrize("shape, match", [
    ([0, 2**62, 2**62], "dimension over"),  # zero elements, but no array can take the shape
    ([2**40, 0], "dimension over"),
    ([1, 1, 1, 1, 1], "at most 4"),
    ([2, -1], "negative"),
])
def test_shapes_no_array_can_take_are_refused_naming_the_field(shape, match):
    for sparse in (False, True):
        msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], "<i4").tobytes()
        tensor = datum.loss_fn_inputs["weights"]
        tensor.dtype = pb.DTYPE_FLOAT32
        tensor.shape.extend(shape)
        if sparse:
            tensor.sparse_csr.values = b""
        else:
            tensor.dense = b""
        with pytest.raises(decode.ProtoError, match=match) as info:
            decode.decode_forward_backward_request(msg.SerializeToString())
        assert info.value.field == "data[0].loss_fn_inputs.weights.shape"
