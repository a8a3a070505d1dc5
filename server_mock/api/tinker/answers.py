"""What a Tinker future answers once the service's work behind it is done, by name (``Answer``), so that a worker
started again on the same storage makes the same answer from what the journal kept (``api/tinker/durable.py``).

An op of a training model is accepted with its ``Answer`` (a kind and a few JSON parameters), which is journaled
with the op; the heavy part, a forward result's protobuf, is encoded on the model's thread by ``encode_forward``
(what ``encoder_for`` gives for that journaled answer, so an op queued again after a restart is encoded the same
way), and the rest is
made from the service's result when the future is read. An answer that makes something (the sampler of
``save_weights_and_get_sampling_client``) gives it an id derived from the request's, so making it again gives
the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pytrio_compat.wire import CreateSampler
from server_mock.api.tinker.paths import tinker_metrics, to_tinker_path
from server_mock.api.tinker.proto import encode as results
from server_mock.errors import WorkerError
from server_mock.service.runs import register_front


@dataclass(frozen=True)
class Answer:
    """A registered way of answering (``kind``) with its parameters (JSON values)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)

    def front(self, model_id: str, seq_id: int) -> dict:
        """What is journaled with the op: the Tinker model and seq_id it came as, and this answer."""
        return {"protocol": "tinker", "model_id": model_id, "seq_id": seq_id, "answer": self.kind,
                "params": self.params}


def encode_forward_result(result: dict) -> bytes:
    return results.encode_forward_backward_output(result.get("loss_fn_outputs", []),
                                                  tinker_metrics(result.get("metrics", {})))


def encode_forward(result: dict) -> dict:
    """On the model's thread, once: a forward result as the ForwardBackwardOutput protobuf the client reads."""
    return {"tinker_protobuf": encode_forward_result(result)}


ENCODERS: dict[str, Callable[[dict], dict]] = {"forward": encode_forward}  # model-thread encoders by answer kind


def encoder_for(front: dict) -> Callable[[dict], dict] | None:
    """The model-thread encoder of an op journaled with ``Answer.front``."""
    return ENCODERS.get(front.get("answer", ""))


register_front("tinker", encoder_for)


def optim_metrics(result: dict) -> dict:
    m = result.get("metrics", {})
    metrics = {"grad_norm:mean": m.get("grad_norm"), "learning_rate:mean": m.get("learning_rate"),
               "step:max": m.get("step")}
    return {"metrics": {k: float(v) for k, v in metrics.items() if v is not None}}


def snapshot_sampler_id(request_id: str) -> str:
    """The sampler a ``save_weights_and_get_sampling_client`` request makes: the same for the same request."""
    return "sampler-" + hashlib.sha256(request_id.encode()).hexdigest()[:16]


def converter(state, tenant: str, model, answer: Answer, request_id: str) -> Callable[[dict], Any]:
    """The function that turns the service's result into the answer (it may be async)."""
    kind, params = answer.kind, answer.params
    if kind == "forward":
        return lambda result: result["tinker_protobuf"]
    if kind == "optim":
        return optim_metrics
    if kind == "save":
        return lambda result: {"path": to_tinker_path(result["path"]), "type": params["type"]}
    if kind == "load":
        return lambda result: {"path": params["path"], "model_id": model.model_id, "type": "load_weights"}
    if kind == "snapshot":
        async def sampler_on(result: dict) -> dict:
            samplers = state.service.samplers
            sampler_id = snapshot_sampler_id(request_id)
            try:
                sampler = samplers.get(sampler_id, tenant)
            except WorkerError:
                sampler = await samplers.create(CreateSampler(model_path=result["path"]), tenant, new_id=sampler_id)
            session = state.sessions.get(model.session_id)
            if session is not None:  # its samples may be recorded for stable_reinforce
                state.add_session_sampler(session, sampler.sampler_id)
            return {"sampling_session_id": sampler.sampler_id, "type": "save_weights_for_sampler"}

        return sampler_on
    raise ValueError(f"unknown Tinker answer {kind!r}")


def sample_answer(result: dict, include_prompt: bool, last_n: int | None, topk: int) -> bytes:
    """A sample result as the SampleResponse protobuf (``prompt_logprobs_last_n``: only the last n prompt positions
    carry logprobs)."""
    prompt_lps = _last_n(list(result.get("prompt_logprobs") or []), last_n) if include_prompt else None
    tops = _last_n(list(result.get("topk_prompt_logprobs") or []), last_n) if topk else None
    return results.encode_sample_response(result["sequences"], prompt_lps, tops, topk)


def _last_n(values: list, last_n: int | None) -> list:
    if last_n is None:
        return values
    cut = len(values) - last_n
    return [None] * cut + values[cut:]
