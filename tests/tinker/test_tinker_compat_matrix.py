"""The compatibility matrix of the official ``tinker`` SDK against the worker, generated from the SDK itself.

Every public method of tinker's ``ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient`` is
found by introspection, and each needs a row here: a status and a check that calls it against a real worker and
asserts what it returned (or, for a hosted-only feature, that it is refused with its reason). A method the SDK
gains without a row fails ``test_every_public_method_has_a_row``. Each ``_async`` twin runs its sync method's
check through the twin. docs/tinker.md shows the table ``render_table()`` writes (``test_docs_show_the_table``
keeps them equal); regenerate it with ``python tests/tinker/test_tinker_compat_matrix.py``.
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

KEY = "tml-matrix"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "tinker.md"
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
PROMPT = [1, 30, 31, 32, 33, 34]

SERVED, CLIENT, HOSTED, REFUSED = "served", "client-side", "hosted-only", "refused"


@dataclass
class Row:
    status: str
    note: str
    check: Callable


@dataclass
class Ctx:
    worker: object
    base: str
    sc: tinker.ServiceClient
    rest: tinker.RestClient
    tc: object
    state_path: str
    sampler_path: str
    sampler: object
    state_logprobs: np.ndarray
    datum: types.Datum

    @property
    def run_id(self) -> str:
        return self.state_path.split("/")[2]

    def service_client(self, **kwargs) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.worker.base_url, api_key=KEY, **kwargs)


def resolve(value):
    """What an SDK call gives, waited for: APIFutures (and the backcompat futures) and coroutines."""
    if inspect.iscoroutine(value):
        return resolve(asyncio.run(value))
    if hasattr(value, "result") and callable(value.result) and not isinstance(value, types.ForwardBackwardOutput):
        return value.result(timeout=120)
    return value


def call(obj, name: str, *args, **kwargs):
    return resolve(getattr(obj, name)(*args, **kwargs))


def logprobs(out) -> np.ndarray:
    return out.loss_fn_outputs[0]["logprobs"].to_numpy()


def probe(tc) -> np.ndarray:
    return logprobs(tc.forward([ce_datum()], "cross_entropy").result(60))


def ce_datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                       loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})


def refused(exc_type, words: str, fn: Callable) -> None:
    with pytest.raises(exc_type, match=words):
        fn()


def with_project(fn: Callable):
    os.environ["TINKER_PROJECT_ID"] = "proj"
    try:
        return fn()
    finally:
        os.environ.pop("TINKER_PROJECT_ID", None)


PARAMS = types.SamplingParams(max_tokens=4, seed=5, temperature=1.0, stop=[])


def sample_tokens(sampler) -> list[list[int]]:
    return [s.tokens for s in sampler.sample(types.ModelInput.from_ints(PROMPT), 2, PARAMS).result(60).sequences]


# --- ServiceClient ---------------------------------------------------------------------------------------------

def sc_close(ctx: Ctx, name: str):
    fresh = ctx.service_client()
    session_id = fresh.holder._session_id
    assert session_id in ctx.rest.list_sessions(limit=1000).result(30).sessions
    call(fresh, name, "success")
    refused(tinker.NotFoundError, "session", lambda: ctx.rest.get_session(session_id).result(30))


def sc_copy_weights(ctx: Ctx, name: str):
    refused(tinker.BadRequestError, "copies between projects",
            lambda: with_project(lambda: call(ctx.sc, name, ctx.state_path)))


def sc_create_custom_loss(ctx: Ctx, name: str):
    def squared(logprobs, weights):
        loss = (weights * logprobs * logprobs).sum()
        return loss, {"custom/squared:sum": loss}

    handle = call(ctx.sc, name, squared, {"logprobs": 1, "weights": 1})
    fresh = ctx.sc.create_lora_training_client(ctx.base, rank=4, seed=9).result(60)
    expected = float((probe(fresh).astype(np.float64) ** 2).sum())
    out = fresh.forward_backward_custom([ce_datum()], handle).result(60)
    assert out.metrics["custom/squared:sum"] == pytest.approx(expected, rel=1e-5)


def sc_create_lora_training_client(ctx: Ctx, name: str):
    tc = call(ctx.sc, name, ctx.base, rank=4, seed=2)
    info = tc.get_info()
    assert info.model_data.model_name == ctx.base and info.lora_rank == 4


def sc_create_rest_client(ctx: Ctx, name: str):
    rest = call(ctx.sc, name)
    assert ctx.base in [m.model_name for m in rest.get_server_capabilities().result(30).supported_models]


def sc_create_sampling_client(ctx: Ctx, name: str):
    sampler = call(ctx.sc, name, model_path=ctx.sampler_path)
    assert sample_tokens(sampler) == sample_tokens(ctx.sampler)  # the same weights, the same seed


def sc_create_training_client_from_state(ctx: Ctx, name: str):
    tc = call(ctx.sc, name, ctx.state_path)
    np.testing.assert_allclose(probe(tc), ctx.state_logprobs, atol=1e-6)
    if "optimizer" in name:  # Adam's step count comes back too: the next step is the saved one's successor
        tc.forward_backward([ce_datum()], "cross_entropy").result(60)
        assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(60).metrics["step:max"] == 2
    else:
        tc.forward_backward([ce_datum()], "cross_entropy").result(60)
        assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(60).metrics["step:max"] == 1


def sc_get_console_url(ctx: Ctx, name: str):
    assert call(ctx.sc, name).startswith("https://")


def sc_get_server_capabilities(ctx: Ctx, name: str):
    models = call(ctx.sc, name).supported_models
    assert [m.model_name for m in models] == [ctx.base] and models[0].max_context_length > 0


def get_telemetry(target: str):
    def check(ctx: Ctx, name: str):
        obj = getattr(ctx, target)
        assert call(obj, name) is obj.holder.get_telemetry()

    return check


def sc_holder(ctx: Ctx, name: str):
    holder = getattr(ctx.sc, name)
    assert holder._session_id.startswith("sess-")  # a session of this worker


# --- TrainingClient --------------------------------------------------------------------------------------------

def tc_create_sampling_client(ctx: Ctx, name: str):
    sampler = call(ctx.tc, name, ctx.sampler_path)
    assert sampler.get_base_model() == ctx.base and sample_tokens(sampler) == sample_tokens(ctx.sampler)


def tc_forward(ctx: Ctx, name: str):
    out = call(ctx.tc, name, [ce_datum()], "cross_entropy")
    lp = logprobs(out)
    assert lp.shape == (len(PROMPT) - 1,) and np.all(lp < 0)
    assert out.metrics["loss:sum"] == pytest.approx(-float(lp.astype(np.float64).sum()), rel=1e-5)


def tc_forward_backward(ctx: Ctx, name: str):
    fresh = ctx.sc.create_lora_training_client(ctx.base, rank=4, seed=3).result(60)
    before = probe(fresh)
    out = call(fresh, name, [ce_datum()], "cross_entropy")
    np.testing.assert_allclose(logprobs(out), before, atol=1e-6)
    fresh.optim_step(types.AdamParams(learning_rate=0.05)).result(60)
    assert probe(fresh).sum() > before.sum()  # the gradient was of -sum(lp): the step raised the logprobs


def tc_forward_backward_custom(ctx: Ctx, name: str):
    def loss_fn(data, lps):
        loss = sum((lp * lp).sum() for lp in lps)
        return loss, {"squared": float(loss)}

    fresh = ctx.sc.create_lora_training_client(ctx.base, rank=4, seed=4).result(60)
    expected = float((probe(fresh).astype(np.float64) ** 2).sum())
    out = call(fresh, name, [ce_datum()], loss_fn)
    assert out.metrics["squared"] == pytest.approx(expected, rel=1e-5)


def tc_get_console_url(ctx: Ctx, name: str):
    assert call(ctx.tc, name).startswith("https://")


def tc_get_info(ctx: Ctx, name: str):
    info = call(ctx.tc, name)
    assert info.model_data.model_name == ctx.base and info.model_data.tokenizer_id == ctx.base


def tokenizer_check(target: str):
    def check(ctx: Ctx, name: str):
        from transformers import AutoTokenizer

        tokenizer = call(getattr(ctx, target), name)
        assert tokenizer.encode("hello there") == AutoTokenizer.from_pretrained(ctx.base).encode("hello there")

    return check


def tc_load_state(ctx: Ctx, name: str):
    fresh = ctx.sc.create_lora_training_client(ctx.base, rank=4, seed=1).result(60)
    call(fresh, name, ctx.state_path)
    np.testing.assert_allclose(probe(fresh), ctx.state_logprobs, atol=1e-6)
    fresh.forward_backward([ce_datum()], "cross_entropy").result(60)
    step = fresh.optim_step(types.AdamParams(learning_rate=1e-3)).result(60).metrics["step:max"]
    assert step == (2 if "optimizer" in name else 1)


def tc_optim_step(ctx: Ctx, name: str):
    fresh = ctx.sc.create_lora_training_client(ctx.base, rank=4, seed=5).result(60)
    before = probe(fresh)
    fresh.forward_backward([ce_datum()], "cross_entropy").result(60)
    out = call(fresh, name, types.AdamParams(learning_rate=0.05))
    assert out.metrics["step:max"] == 1 and out.metrics["learning_rate:mean"] == pytest.approx(0.05)
    assert not np.allclose(probe(fresh), before)


def tc_save_state(ctx: Ctx, name: str):
    path = call(ctx.tc, name, f"m-{name}").path
    assert path == f"tinker://{ctx.run_id}/weights/m-{name}"
    assert path in [c.tinker_path for c in ctx.rest.list_checkpoints(ctx.run_id).result(30).checkpoints]


def tc_save_weights_and_get_sampling_client(ctx: Ctx, name: str):
    sampler = call(ctx.tc, name)
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result(60).sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + seq.tokens)).result(60)
    np.testing.assert_allclose(scored[len(PROMPT):], seq.logprobs, atol=1e-4)


def tc_save_weights_external(ctx: Ctx, name: str):
    path = call(ctx.tc, name, f"x-{name}", ttl_seconds=3600).path
    assert path == f"tinker://{ctx.run_id}/external_weights/x-{name}"
    urls = ctx.rest.get_external_weights_urls(path).result(30).urls
    assert sorted(urls) == ["adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"]


def tc_save_weights_for_sampler(ctx: Ctx, name: str):
    path = call(ctx.tc, name, f"m-{name}").path
    assert path == f"tinker://{ctx.run_id}/sampler_weights/m-{name}"
    assert ctx.rest.get_weights_info_by_tinker_path(path).result(30).lora_rank == 4


# --- SamplingClient --------------------------------------------------------------------------------------------

def sp_compute_logprobs(ctx: Ctx, name: str):
    scored = call(ctx.sampler, name, types.ModelInput.from_ints(PROMPT))
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], ctx.state_logprobs, atol=1e-4)  # the sampler has the state's weights


def sp_create(ctx: Ctx, name: str):
    sampler = call(tinker.SamplingClient, name, ctx.sc.holder, model_path=ctx.sampler_path)
    assert sample_tokens(sampler) == sample_tokens(ctx.sampler)


def sp_from_sampler_handle(ctx: Ctx, name: str):
    sampler = call(tinker.SamplingClient, name, ctx.sampler.get_sampler_handle(), api_key=KEY)
    assert sample_tokens(sampler) == sample_tokens(ctx.sampler)


def sp_get_base_model(ctx: Ctx, name: str):
    assert call(ctx.sampler, name) == ctx.base


def sp_get_sampler_handle(ctx: Ctx, name: str):
    handle = json.loads(base64.urlsafe_b64decode(call(ctx.sampler, name)))
    assert handle["sampling_session_id"] == ctx.sampler._sampling_session_id and KEY not in json.dumps(handle)


def sp_on_queue_state_change(ctx: Ctx, name: str):
    from tinker.lib.api_future_impl import QueueState

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("tinker")
    logger.addHandler(handler)
    try:
        ctx.sampler._last_queue_state_logged = 0.0
        call(ctx.sampler, name, QueueState.PAUSED_CAPACITY, "busy")
    finally:
        logger.removeHandler(handler)
    assert any("paused" in m and "busy" in m for m in seen)


def sp_sample(ctx: Ctx, name: str):
    first = call(ctx.sampler, name, types.ModelInput.from_ints(PROMPT), 2, PARAMS)
    second = call(ctx.sampler, name, prompt=types.ModelInput.from_ints(PROMPT), num_samples=2, sampling_params=PARAMS)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in second.sequences]
    assert all(len(s.tokens) == 4 and len(s.logprobs) == 4 and s.sequence_id for s in first.sequences)


# --- RestClient ------------------------------------------------------------------------------------------------

def hosted(words: str, args: Callable, exc=tinker.BadRequestError):
    def check(ctx: Ctx, name: str):
        refused(exc, words, lambda: with_project(lambda: call(ctx.rest, name, *args(ctx))))

    return check


def rest_delete(by_path: bool):
    def check(ctx: Ctx, name: str):
        path = ctx.tc.save_state(f"del-{name}").result(60).path
        if by_path:
            call(ctx.rest, name, path)
        else:
            call(ctx.rest, name, ctx.run_id, f"weights/del-{name}")
        assert path not in [c.tinker_path for c in ctx.rest.list_checkpoints(ctx.run_id).result(30).checkpoints]
        refused(tinker.NotFoundError, "no checkpoint", lambda: ctx.rest.delete_checkpoint_from_tinker_path(path)
                .result(30))

    return check


def rest_get_external_weights_urls(ctx: Ctx, name: str):
    path = ctx.tc.save_weights_external(f"u-{name}").result(60).path
    signed = call(ctx.rest, name, path)
    assert signed.expires.tzinfo is not None and sorted(signed.urls)[0] == "adapter_config.json"
    assert httpx.get(signed.urls["adapter_config.json"]).json()["r"] == 4  # fetched without the API key
    refused(tinker.NotFoundError, "no external weights",
            lambda: call(ctx.rest, name, f"tinker://{ctx.run_id}/external_weights/none"))


def rest_get_sampler(ctx: Ctx, name: str):
    info = call(ctx.rest, name, ctx.sampler._sampling_session_id)
    assert info.base_model == ctx.base and info.model_path == ctx.sampler_path


def rest_get_server_capabilities(ctx: Ctx, name: str):
    assert ctx.base in [m.model_name for m in call(ctx.rest, name).supported_models]


def rest_get_session(ctx: Ctx, name: str):
    info = call(ctx.rest, name, ctx.sc.holder._session_id)
    assert ctx.sampler._sampling_session_id in info.sampler_ids and ctx.run_id in info.training_run_ids
    assert info.user_metadata == {"matrix": "yes"}


def rest_get_training_run(by_path: bool):
    def check(ctx: Ctx, name: str):
        run = call(ctx.rest, name, ctx.state_path if by_path else ctx.run_id)
        assert run.training_run_id == ctx.run_id and run.user_metadata == {"renderer_name": "role_colon"}
        assert run.base_model == ctx.base and run.lora_rank == 4

    return check


def rest_get_weights_info_by_tinker_path(ctx: Ctx, name: str):
    info = call(ctx.rest, name, ctx.state_path)
    assert info.base_model == ctx.base and info.lora_rank == 4 and info.is_lora


def rest_list_checkpoints(ctx: Ctx, name: str):
    listed = {c.tinker_path: c.checkpoint_type for c in call(ctx.rest, name, ctx.run_id).checkpoints}
    assert listed[ctx.state_path] == "training" and listed[ctx.sampler_path] == "sampler"


def rest_list_sessions(ctx: Ctx, name: str):
    assert ctx.sc.holder._session_id in call(ctx.rest, name, limit=1000).sessions


def rest_list_training_runs(ctx: Ctx, name: str):
    out = call(ctx.rest, name, limit=1000)
    assert ctx.run_id in [r.training_run_id for r in out.training_runs] and out.cursor.total_count >= 1


def rest_list_user_checkpoints(ctx: Ctx, name: str):
    out = call(ctx.rest, name, limit=1000)
    paths = [c.tinker_path for c in out.checkpoints]
    assert ctx.state_path in paths and ctx.sampler_path in paths and out.cursor.total_count == len(paths)


def rest_search_sessions(ctx: Ctx, name: str):
    found = call(ctx.rest, name, types.SessionSearchRequest(user_metadata={"matrix": "yes"}))
    assert ctx.sc.holder._session_id in [s.session_id for s in found.sessions]


def rest_set_ttl(ctx: Ctx, name: str):
    path = ctx.tc.save_state(f"ttl-{name}").result(60).path
    call(ctx.rest, name, path, 7200)
    (entry,) = [c for c in ctx.rest.list_checkpoints(ctx.run_id).result(30).checkpoints if c.tinker_path == path]
    assert entry.expires_at is not None
    call(ctx.rest, name, path, None)
    (entry,) = [c for c in ctx.rest.list_checkpoints(ctx.run_id).result(30).checkpoints if c.tinker_path == path]
    assert entry.expires_at is None


def rest_publish(ctx: Ctx, name: str):
    refused(tinker.BadRequestError, "publishing is not supported", lambda: call(ctx.rest, name, ctx.state_path))


def rest_whoami(ctx: Ctx, name: str):
    refused(RuntimeError, "JWT", lambda: call(ctx.rest, name))


# --- the rows --------------------------------------------------------------------------------------------------

PROJECTS = "projects are a hosted-service feature: no projects here"
ROWS: dict[str, Row] = {
    "ServiceClient.close": Row(SERVED, "`POST /sessions/{id}/finish`; the session's models are deleted", sc_close),
    "ServiceClient.copy_weights": Row(HOSTED, "copies between projects (`POST /copy_weights`): 400 with the "
                                              "reason", sc_copy_weights),
    "ServiceClient.create_custom_loss": Row(CLIENT, "traced and run client-side (`custom_loss_server_side` is off)",
                                            sc_create_custom_loss),
    "ServiceClient.create_lora_training_client": Row(SERVED, "`POST /create_model` (+ `user_metadata`), "
                                                             "`POST /get_info`", sc_create_lora_training_client),
    "ServiceClient.create_rest_client": Row(CLIENT, "a `RestClient` on the same base URL and key",
                                            sc_create_rest_client),
    "ServiceClient.create_sampling_client": Row(SERVED, "`POST /create_sampling_session`",
                                                sc_create_sampling_client),
    "ServiceClient.create_training_client_from_state": Row(SERVED, "`POST /load_weights` (a new model)",
                                                           sc_create_training_client_from_state),
    "ServiceClient.create_training_client_from_state_with_optimizer": Row(
        SERVED, "`POST /load_weights` with the Adam state", sc_create_training_client_from_state),
    "ServiceClient.get_console_url": Row(CLIENT, "a URL of the hosted console (nothing there for this worker)",
                                         sc_get_console_url),
    "ServiceClient.get_server_capabilities": Row(SERVED, "`GET /get_server_capabilities`",
                                                 sc_get_server_capabilities),
    "ServiceClient.get_telemetry": Row(CLIENT, "the SDK's own telemetry object (`POST /telemetry` is accepted "
                                               "and dropped)", get_telemetry("sc")),
    "ServiceClient.holder": Row(CLIENT, "the SDK's connection holder (a property)", sc_holder),
    "TrainingClient.create_sampling_client": Row(SERVED, "`POST /create_sampling_session`",
                                                 tc_create_sampling_client),
    "TrainingClient.forward": Row(SERVED, "`POST /forward_backward` (`forward_only`, protobuf)", tc_forward),
    "TrainingClient.forward_backward": Row(SERVED, "`POST /forward_backward` (protobuf; every built-in loss, "
                                                   "provenance spans, `[N, K]` soft targets)", tc_forward_backward),
    "TrainingClient.forward_backward_custom": Row(SERVED, "a forward pass, then `cross_entropy` with "
                                                          "`weights = -dL/dlogprobs`", tc_forward_backward_custom),
    "TrainingClient.get_console_url": Row(CLIENT, "a URL of the hosted console", tc_get_console_url),
    "TrainingClient.get_info": Row(SERVED, "`POST /get_info` (cached)", tc_get_info),
    "TrainingClient.get_telemetry": Row(CLIENT, "the SDK's own telemetry object", get_telemetry("tc")),
    "TrainingClient.get_tokenizer": Row(CLIENT, "`AutoTokenizer` of `get_info`'s `tokenizer_id` (the served "
                                                "folder or hub id, `--tokenizer-id`)", tokenizer_check("tc")),
    "TrainingClient.load_state": Row(SERVED, "`POST /load_weights` into the model", tc_load_state),
    "TrainingClient.load_state_with_optimizer": Row(SERVED, "`POST /load_weights` with the Adam state",
                                                    tc_load_state),
    "TrainingClient.optim_step": Row(SERVED, "`POST /optim_step` (AdamW)", tc_optim_step),
    "TrainingClient.save_state": Row(SERVED, "`POST /save_weights` (+ `ttl_seconds`, `user_metadata`)",
                                     tc_save_state),
    "TrainingClient.save_weights_and_get_sampling_client": Row(SERVED, "`POST /save_weights_for_sampler` (an "
                                                                       "in-memory snapshot; `record_stability_info`)",
                                                               tc_save_weights_and_get_sampling_client),
    "TrainingClient.save_weights_external": Row(SERVED, "`POST /save_weights_external` (+ `ttl_seconds`, "
                                                        "`age_encryption_recipients`): the model's adapter as an "
                                                        "export to download", tc_save_weights_external),
    "TrainingClient.save_weights_for_sampler": Row(SERVED, "`POST /save_weights_for_sampler` (+ `ttl_seconds`, "
                                                           "`user_metadata`)", tc_save_weights_for_sampler),
    "SamplingClient.compute_logprobs": Row(SERVED, "`POST /asample` (prompt logprobs)", sp_compute_logprobs),
    "SamplingClient.create": Row(SERVED, "`POST /create_sampling_session`, `GET /samplers/{id}`", sp_create),
    "SamplingClient.from_sampler_handle": Row(CLIENT, "a client from a handle (then `GET /samplers/{id}`)",
                                              sp_from_sampler_handle),
    "SamplingClient.get_base_model": Row(SERVED, "`GET /samplers/{id}` when not known", sp_get_base_model),
    "SamplingClient.get_sampler_handle": Row(CLIENT, "a credential-free handle", sp_get_sampler_handle),
    "SamplingClient.get_telemetry": Row(CLIENT, "the SDK's own telemetry object", get_telemetry("sampler")),
    "SamplingClient.get_tokenizer": Row(CLIENT, "`AutoTokenizer` of the base model's name (serve it under a hub id "
                                                "or its folder)", tokenizer_check("sampler")),
    "SamplingClient.on_queue_state_change": Row(CLIENT, "the SDK's log of a paused queue (the worker never pauses "
                                                        "one: a full queue is a 429)", sp_on_queue_state_change),
    "SamplingClient.sample": Row(SERVED, "`POST /asample` (`record_stability_info` records the sequences)",
                                 sp_sample),
    "RestClient.assign_session_project": Row(HOSTED, PROJECTS, hosted("projects", lambda c: (
        c.sc.holder._session_id, "proj"))),
    "RestClient.copy_weights": Row(HOSTED, "copies between projects", hosted("copies between projects",
                                                                             lambda c: (c.state_path,))),
    "RestClient.delete_checkpoint": Row(SERVED, "`DELETE /training_runs/{run}/checkpoints/{kind}/{name}`",
                                        rest_delete(False)),
    "RestClient.delete_checkpoint_from_tinker_path": Row(SERVED, "the same, by `tinker://` path", rest_delete(True)),
    "RestClient.export_session_trace": Row(HOSTED, "Perfetto traces of hosted sessions: the export job answers "
                                                   "`failed` with the reason", hosted("trace export", lambda c: (
                                                       c.sc.holder._session_id,), RuntimeError)),
    "RestClient.get_audit_log": Row(HOSTED, "the organisation's audit log", hosted("audit log", lambda c: ())),
    "RestClient.get_billing_usage": Row(HOSTED, "billing", hosted("billing", lambda c: ("2026-01-01", "2026-02-01"))),
    "RestClient.get_current_checkpoint_storage_usage": Row(HOSTED, "billing (storage usage)",
                                                           hosted("billing", lambda c: ())),
    "RestClient.get_external_weights_urls": Row(SERVED, "`GET .../external_weights/{name}/external_weights_urls`: "
                                                        "one signed URL per file, fetched without a key",
                                                rest_get_external_weights_urls),
    "RestClient.get_sampler": Row(SERVED, "`GET /samplers/{id}`", rest_get_sampler),
    "RestClient.get_server_capabilities": Row(SERVED, "`GET /get_server_capabilities`",
                                              rest_get_server_capabilities),
    "RestClient.get_session": Row(SERVED, "`GET /sessions/{id}` (live sessions; `user_metadata`)", rest_get_session),
    "RestClient.get_telemetry": Row(CLIENT, "the SDK's own telemetry object", get_telemetry("rest")),
    "RestClient.get_training_run": Row(SERVED, "`GET /training_runs/{id}` (run or model id; `user_metadata`)",
                                       rest_get_training_run(False)),
    "RestClient.get_training_run_by_tinker_path": Row(SERVED, "the same, by `tinker://` path",
                                                      rest_get_training_run(True)),
    "RestClient.get_weights_info_by_tinker_path": Row(SERVED, "`POST /weights_info`",
                                                      rest_get_weights_info_by_tinker_path),
    "RestClient.list_checkpoints": Row(SERVED, "`GET /training_runs/{id}/checkpoints`", rest_list_checkpoints),
    "RestClient.list_sessions": Row(SERVED, "`GET /sessions`", rest_list_sessions),
    "RestClient.list_training_runs": Row(SERVED, "`GET /training_runs` (live runs and runs with checkpoints)",
                                         rest_list_training_runs),
    "RestClient.list_user_checkpoints": Row(SERVED, "`GET /checkpoints`, newest first", rest_list_user_checkpoints),
    "RestClient.publish_checkpoint_from_tinker_path": Row(REFUSED, "a checkpoint is visible to its API key only "
                                                                   "(400 with the reason)", rest_publish),
    "RestClient.search_sessions": Row(SERVED, "`POST /sessions/search` over the key's live sessions (no projects)",
                                      rest_search_sessions),
    "RestClient.set_checkpoint_ttl_from_tinker_path": Row(SERVED, "`PUT .../ttl` (1 h to 10 y, or none); expiry "
                                                                  "is a 404 at once and a sweep from disk",
                                                          rest_set_ttl),
    "RestClient.unpublish_checkpoint_from_tinker_path": Row(REFUSED, "as publishing", rest_publish),
    "RestClient.whoami": Row(HOSTED, "identity from a JWT: the worker uses API keys (the SDK raises)", rest_whoami),
}


def public_methods() -> list[str]:
    """Every public member of the four client classes, as ``Class.name`` (introspection of the installed SDK)."""
    out = []
    for cls_name in CLASSES:
        cls = getattr(tinker, cls_name)
        out += [f"{cls_name}.{name}" for name, _ in inspect.getmembers(cls) if not name.startswith("_")]
    return out


def row_of(method: str) -> tuple[Row, str]:
    """A method's row (an ``_async`` twin takes its sync method's) and what the matrix says of it."""
    base = re.sub(r"_async$", "", method)
    row = ROWS.get(method) or ROWS.get(base)
    if row is None:
        raise KeyError(method)
    return row, ("deprecated async twin: " if method != base and method not in ROWS else "") + row.note


def render_table() -> str:
    lines = [f"Generated from `tinker=={tinker.__version__}` by tests/tinker/test_tinker_compat_matrix.py "
             f"({len(public_methods())} public methods).", "",
             "| method | status | how |", "| --- | --- | --- |"]
    for method in public_methods():
        row, note = row_of(method)
        lines.append(f"| `{method}` | {row.status} | {note} |")
    return "\n".join(lines)


def test_every_public_method_has_a_row():
    methods = public_methods()
    assert tinker.__version__ == "0.38.0" and len(methods) == 101
    missing = [m for m in methods if re.sub(r"_async$", "", m) not in ROWS and m not in ROWS]
    assert not missing, f"tinker's public methods without a row in the matrix: {missing}"
    stale = sorted(set(ROWS) - set(methods))
    assert not stale, f"rows for methods the SDK no longer has: {stale}"


def test_docs_show_the_table():
    text = DOCS.read_text()
    start, end = "<!-- compat-matrix:start -->", "<!-- compat-matrix:end -->"
    assert start in text and end in text
    shown = text.split(start)[1].split(end)[0].strip()
    assert shown == render_table(), "docs/tinker.md's matrix is stale: python tests/tinker/test_tinker_compat_matrix.py"


@pytest.fixture(scope="module")
def ctx(tiny_model_dir, tmp_path_factory):
    from support import running_worker

    warnings.simplefilter("ignore", FutureWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    base = str(tiny_model_dir)
    with running_worker(tiny_model_dir, tmp_path_factory.mktemp("matrix"), api_keys=[KEY], model_name=base,
                        in_process=True) as w:
        sc = tinker.ServiceClient(base_url=w.base_url, api_key=KEY, user_metadata={"matrix": "yes"})
        rest = tinker.RestClient(base_url=w.base_url, api_key=KEY)
        tc = sc.create_lora_training_client(base, rank=4, seed=1,
                                            user_metadata={"renderer_name": "role_colon"}).result(60)
        tc.forward_backward([ce_datum()], "cross_entropy").result(60)
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result(60)
        state_path = tc.save_state("m-state").result(60).path
        sampler_path = tc.save_weights_for_sampler("m-sampler").result(60).path
        sampler = sc.create_sampling_client(model_path=sampler_path).result(60)
        yield Ctx(w, base, sc, rest, tc, state_path, sampler_path, sampler, probe(tc), ce_datum())
        sc.close("success").result(30)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("method", public_methods())
def test_method_against_the_worker(ctx, method):
    row, _ = row_of(method)
    row.check(ctx, method.split(".", 1)[1])


if __name__ == "__main__":
    print(render_table())
