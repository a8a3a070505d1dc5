"""The Tinker wire protocol spoken by hand (httpx + the official client's own protobuf module), for
tests that send what the official client never would."""

from __future__ import annotations

import time

import httpx
import numpy as np
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

PROTO_HEADERS = {"Content-Type": "application/x-protobuf"}


class RawTinker:
    def __init__(self, base_url: str, key: str, timeout: float = 60.0) -> None:
        self.base = base_url + "/api/v1"
        self.http = httpx.Client(headers={"X-API-Key": key}, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(self.base + path, **kwargs)

    def result(self, request_id: str, timeout: float = 60.0):
        """The future's answer: ForwardBackwardOutput, raw SampleResponse bytes, or a dict (JSON)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.post("/retrieve_future", json={"request_id": request_id, "allow_metadata_only": True},
                          headers={"Accept": "application/x-protobuf"})
            assert r.status_code == 200, r.text
            if "protobuf" in r.headers["content-type"]:
                return r.content
            body = r.json()
            if body.get("type") != "try_again" or time.monotonic() > deadline:
                return body

    def session(self) -> str:
        return self.post("/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]

    def model(self, base_model: str, seed: int = 0, rank: int = 4) -> str:
        session = self.session()
        created = self.post("/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": base_model,
            "lora_config": {"rank": rank, "seed": seed}, "type": "create_model"}).json()
        out = self.result(created["request_id"])
        assert out.get("model_id") == created["model_id"], out
        return created["model_id"]

    def forward_backward(self, model_id: str, seq_id: int, body: bytes | None = None, **kw) -> httpx.Response:
        return self.post("/forward_backward", content=body if body is not None else fwd_body(model_id, seq_id, **kw),
                         headers=PROTO_HEADERS)

    def run_forward(self, model_id: str, seq_id: int, **kw):
        """Send one forward_backward and wait for its ForwardBackwardOutput."""
        r = self.forward_backward(model_id, seq_id, **kw)
        assert r.status_code == 200, r.text
        out = self.result(r.json()["request_id"])
        assert isinstance(out, bytes), out
        return deserialize_forward_backward_output(out)

    def optim_step(self, model_id: str, seq_id, lr: float = 1e-2) -> httpx.Response:
        return self.post("/optim_step", json={"model_id": model_id, "seq_id": seq_id, "type": "optim_step",
                                              "adam_params": {"learning_rate": lr}})


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def fwd_message(model_id: str, seq_id: int, tokens: list[int] | None = None, forward_only: bool = False,
                loss_fn: str = "cross_entropy") -> pb.ForwardBackwardRequest:
    tokens = tokens or [5, 9, 14, 200, 31, 7]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(tokens)], loss_fn=loss_fn),
        model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message


def fwd_body(model_id: str, seq_id: int, **kw) -> bytes:
    return fwd_message(model_id, seq_id, **kw).SerializeToString()


def logprobs(output) -> np.ndarray:
    return output.loss_fn_outputs[0]["logprobs"].to_numpy()
