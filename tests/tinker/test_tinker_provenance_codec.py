"""Provenance spans and [N, K] results on the wire: the official SDK's request bytes decoded by the worker, every
span bound at the limit and one past, ``user_metadata`` bounds, and [N, K] outputs read back by the SDK."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from server_mock.api.tinker import records
from server_mock.api.tinker.proto import decode, encode
from server_mock.errors import WorkerError
from server_mock.service.stability import Span


def request(datum: types.Datum) -> bytes:
    fb = types.ForwardBackwardInput(data=[datum], loss_fn="stable_reinforce")
    req = types.ForwardBackwardRequest(forward_backward_input=fb, model_id="m", seq_id=1)
    return forward_backward_request_to_proto(req).SerializeToString()


def rl_datum(n_prompt: int = 3, n_sampled: int = 2, sid: str = "tk-1:0") -> types.Datum:
    tokens = list(range(1, n_prompt + n_sampled))
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": [0] * (n_prompt - 1) + [7] * n_sampled,
                                        "logprobs": [0.0] * len(tokens), "advantages": [0.0] * len(tokens)})
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
                     types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=n_sampled)])


def test_the_sdks_spans_decode():
    (datum,) = decode.decode_forward_backward_request(request(rl_datum(n_sampled=1))).data
    assert datum.model_input_spans == [Span("prompt", "tk-1:0", 0, 3), Span("sampled", "tk-1:0", 0, 0)]
    assert datum.loss_fn_input_spans == [Span("prompt", "tk-1:0", 1, 2), Span("sampled", "tk-1:0", 0, 1)]
    plain = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    (datum,) = decode.decode_forward_backward_request(request(plain)).data
    assert datum.model_input_spans is None and datum.loss_fn_input_spans is None


def with_spans(model_spans, loss_spans, n: int = 4):
    message = decode.pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="stable_reinforce")
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype="<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = decode.DTYPE_INT64, np.ones(n, "<i8").tobytes()
    targets.shape.append(n)
    for out, spans in ((datum.model_input_spans, model_spans), (datum.loss_fn_input_spans, loss_spans)):
        for kind, sid, offset, length in spans:
            ref = getattr(out.add(), kind)
            ref.sequence_id, ref.offset, ref.length = sid, offset, length
    return message.SerializeToString()


def refusal(body: bytes) -> decode.ProtoError:
    with pytest.raises(decode.ProtoError) as e:
        decode.decode_forward_backward_request(body)
    return e.value


def test_span_bounds_at_the_limit_and_one_past():
    whole = [("prompt_tokens", "s", 0, 4)]
    empty = ("sampled_tokens", "s", 0, 0)
    at_limit = whole + [empty] * 9  # 2 x 4 + 2 = 10 runs for 4 positions
    decode.decode_forward_backward_request(with_spans(at_limit, whole))
    e = refusal(with_spans(at_limit + [empty], whole))
    assert e.status == 413 and e.field == "data[0].model_input_spans" and "at most 10" in str(e)
    decode.decode_forward_backward_request(with_spans([("prompt_tokens", "x" * 256, 0, 4)], whole))
    assert refusal(with_spans([("prompt_tokens", "x" * 257, 0, 4)], whole)).field == \
        "data[0].model_input_spans[0].sequence_id"
    assert refusal(with_spans([("prompt_tokens", "", 0, 4)], whole)).field == "data[0].model_input_spans[0].sequence_id"
    decode.decode_forward_backward_request(with_spans([("prompt_tokens", "s", 2**31 - 1, 4)], whole))
    assert "offset" in str(refusal(with_spans([("prompt_tokens", "s", 2**31, 4)], whole)))
    assert "offset" in str(refusal(with_spans([("prompt_tokens", "s", -1, 4)], whole)))
    e = refusal(with_spans([("prompt_tokens", "s", 0, 3)], whole))
    assert e.field == "data[0].model_input_spans" and "tile" in str(e)
    e = refusal(with_spans(whole, [("sampled_tokens", "s", 0, 5)]))
    assert e.field == "data[0].loss_fn_input_spans" and "tile" in str(e)
    assert "together" in str(refusal(with_spans(whole, [])))


def test_user_metadata_bounds():
    at_limit = {f"k{i}": "v" for i in range(64)}
    assert records.user_metadata(at_limit) == at_limit
    with pytest.raises(WorkerError, match="at most 64"):
        records.user_metadata({**at_limit, "one-more": "v"})
    assert records.user_metadata({"k" * 256: "v" * 4096, "n": 3, "d": {"a": 1}}) == \
        {"k" * 256: "v" * 4096, "n": "3", "d": '{"a": 1}'}
    with pytest.raises(WorkerError) as e:
        records.user_metadata({"k" * 257: "v"})
    assert e.value.field.startswith("user_metadata")
    with pytest.raises(WorkerError) as e:
        records.user_metadata({"k": "v" * 4097})
    assert e.value.field == "user_metadata.k"
    with pytest.raises(WorkerError):
        records.user_metadata(["not", "a", "dict"])


def test_soft_target_outputs_read_back_in_the_sdk():
    outputs = [{"logprobs": np.full((3, 2), -1.5, np.float32), "elementwise_loss": np.ones(3, np.float32)},
               {"logprobs": np.full((2, 2), -0.5, np.float32), "elementwise_loss": np.ones(2, np.float32)},
               {"logprobs": np.full(4, -2.0, np.float32), "elementwise_loss": np.ones(4, np.float32)},
               {"logprobs": np.full((1, 5), -3.0, np.float32), "elementwise_loss": np.ones(1, np.float32)}]
    back = deserialize_forward_backward_output(encode.encode_forward_backward_output(outputs, {"loss:sum": 1.0}))
    assert [o["logprobs"].shape for o in back.loss_fn_outputs] == [[3, 2], [2, 2], [4], [1, 5]]
    for sent, got in zip(outputs, back.loss_fn_outputs):
        np.testing.assert_array_equal(got["logprobs"].to_numpy().reshape(sent["logprobs"].shape), sent["logprobs"])
        assert got["elementwise_loss"].shape == [len(sent["elementwise_loss"])]
