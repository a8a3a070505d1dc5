"""The Actor route of a sampling run: ``POST v1/sampling-runs/{cuid}/sample`` (JSON both ways).

A request is checked in full and queued on the service's samplers (batched with others on the same weights, as
for every protocol) before anything is answered, so a bad request gets a 4xx naming its field. A retry with the
same ``request_id`` (the SDK re-sends after network errors) gets the same sample, never a second one. When the
answer takes longer than ``--pytrio-sample-keepalive`` seconds, the response starts with whitespace, one chunk per
interval, which the SDK skips; a failure after that point can no longer change the status, so the body then
carries a ``sequences`` value the SDK refuses (``actor.invalid_response``, with the reason) instead of an empty
success.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pytrio_compat.wire import SampleRequest, WireSamplingParams
from server_mock.api.pytrio.actor import caller
from server_mock.api.pytrio.endpoint import error_body, read_model
from server_mock.api.pytrio.kept_answers import KeptAnswers
from server_mock.api.pytrio.sample_wire import SampleIn, SampleOut, SampleSequenceOut, SampleUsageOut
from server_mock.api.pytrio.state import PytrioState, SamplingRun
from server_mock.engine.jobs import job_result
from server_mock.engine.requests import approx_bytes
from server_mock.errors import WorkerError

REMEMBERED_REQUESTS = 64  # request ids per sampling run whose answers a retry gets again
LOWEST_LOGPROB = -3.0e38  # JSON has no -inf


def _finite(value: float | None) -> float | None:
    if value is None:
        return None
    return value if math.isfinite(value) else LOWEST_LOGPROB


def service_request(body: SampleIn) -> SampleRequest:
    params = body.sampling_params
    return SampleRequest(
        prompt_tokens=body.prompt.tokens(), prompt_images=body.prompt.images(), num_samples=body.num_samples,
        sampling_params=WireSamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                           top_k=params.top_k, top_p=params.top_p, seed=params.seed, stop=params.stop,
                                           stop_token_ids=params.stop_token_ids),
        include_prompt_logprobs=body.return_prompt_logprobs, topk_prompt_logprobs=body.topk_prompt_logprobs,
        return_text=body.return_text)


def answer_shape(body: SampleIn) -> dict:
    """What of a request its answer depends on (journaled with it, so that its answer is the same after a
    restart)."""
    return {"request_id": body.request_id, "token_logprobs": body.return_token_logprobs, "text": body.return_text,
            "prompt_logprobs": body.return_prompt_logprobs, "topk": body.topk_prompt_logprobs}


def answer(run_cuid: str, shape: dict, result: dict) -> dict:
    sequences = [SampleSequenceOut(tokens=list(s["tokens"]),
                                   logprobs=[_finite(x) for x in s["logprobs"]] if shape["token_logprobs"] else [],
                                   text=s.get("text") if shape["text"] else None, stop_reason=s["stop_reason"])
                 for s in result["sequences"]]
    prompt = [_finite(x) for x in result.get("prompt_logprobs") or []] if shape["prompt_logprobs"] else None
    topk = None
    if shape["topk"]:
        topk = [None if row is None else [(int(t), _finite(lp)) for t, lp in row]
                for row in result.get("topk_prompt_logprobs") or []]
    out = SampleOut(request_id=shape["request_id"], sampling_run=run_cuid, sequences=sequences, prompt_logprobs=prompt,
                    topk_prompt_logprobs=topk, usage=SampleUsageOut(input_tokens=result.get("input_tokens", 0),
                                                                    output_tokens=result.get("output_tokens", 0)))
    return out.model_dump(mode="json")


async def sample(state: PytrioState, request: Request):
    cuid = request.path_params["run"]
    grant = caller(state, request, "sampling")
    if grant.run_cuid != cuid:
        raise WorkerError(404, "sampling_run_not_found", f"sampling_run: {cuid[:64]!r} is not the run this actor "
                                                         "token opens", "sampling_run_cuid")
    run = state.sampling_run(cuid, grant.tenant)
    state.touch_session(run.session_cuid)
    body = await read_model(request, SampleIn, state.service.limits.max_body_bytes)
    task = run.samples.get(body.request_id)
    if task is None:
        shape = answer_shape(body)
        job = await state.service.samplers.submit_async(run.sampler_id, service_request(body), run.tenant,
                                                        front={"protocol": "pytrio", "sampling_run": run.cuid,
                                                               "shape": shape})
        task = remember(run, shape, job, state.answers)
    return await respond(task, state.options.pytrio_sample_keepalive)


def remember(run: SamplingRun, shape: dict, job, answers: KeptAnswers | None = None) -> asyncio.Future:
    """The task answering the request (and a retry of it: same ``request_id``) once ``job`` ends; its answer is
    counted in the key's ``answers`` (``--max-result-bytes``) while it is remembered."""
    task = asyncio.ensure_future(job_result(job, lambda result: answer(run.cuid, shape, result)))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by respond(); never "unretrieved"
    request_id = shape["request_id"]
    run.samples[request_id] = task
    while len(run.samples) > REMEMBERED_REQUESTS:
        old_id, _ = run.samples.popitem(last=False)
        if answers is not None:
            answers.drop(run.tenant, ("sample", run.cuid, old_id))
    if answers is not None:
        def kept(done: asyncio.Future) -> None:
            if run.samples.get(request_id) is done and not done.cancelled() and done.exception() is None:
                answers.keep(run.tenant, ("sample", run.cuid, request_id), approx_bytes(done.result()),
                             lambda: run.samples.pop(request_id, None))

        task.add_done_callback(kept)
    return task


async def respond(task: asyncio.Future, keepalive: float) -> Response:
    """The answer, or, when it takes longer than ``keepalive``, whitespace until it comes, then the answer."""
    done, _ = await asyncio.wait({task}, timeout=keepalive)
    if done:
        return JSONResponse(task.result())  # a WorkerError raised here is rendered by the endpoint

    async def body() -> AsyncIterator[bytes]:
        while True:
            yield b" \n"
            finished, _ = await asyncio.wait({task}, timeout=keepalive)
            if finished:
                break
        try:
            payload = task.result()
        except WorkerError as exc:
            payload = {"sequences": f"sampling failed after the answer started: {exc.code}: {exc.message}",
                       "error": error_body(exc)}
        except asyncio.CancelledError:
            payload = {"sequences": "sampling failed: the sampling run was released", "error": {"code": "cancelled"}}
        yield json.dumps(payload).encode()

    return StreamingResponse(body(), media_type="application/json")
