"""Tinker routes for sampling: sampling sessions, sampler info, and ``asample`` (whose result is a
protobuf ``SampleResponse``, encoded in a thread).

An ``asample`` that names no sampling session (the older addressing, by ``base_model`` or
``model_path``) reuses one sampler per (API key, base model, weights path), the most recent
``--tinker-implicit-samplers`` of them per key, instead of making a sampler per request.
"""

from __future__ import annotations

import asyncio

from pydantic import ValidationError
from starlette.requests import Request

from pytrio_compat.wire import ImageChunk
from pytrio_compat.wire import CreateSampler, SampleRequest, WireImage, WireSamplingParams
from server_mock.api.bodies import first_error
from server_mock.api.tinker import provenance, schemas
from server_mock.api.tinker.answers import sample_answer
from server_mock.api.tinker.endpoint import read
from server_mock.api.tinker.futures import raise_
from server_mock.api.tinker.paths import to_tinker_path, to_trio_path
from server_mock.api.tinker.state import TinkerState
from server_mock.engine.jobs import job_result
from server_mock.errors import WorkerError, bad_request
from server_mock.service.rate_limits import RateLimited

DEFAULT_MAX_TOKENS = 256  # sampling_params.max_tokens when the client leaves it unset


def _create_body(body: schemas.CreateSamplingSession | schemas.Asample) -> CreateSampler:
    model_path = body.model_path
    return CreateSampler(base_model=body.base_model,
                         model_path=to_trio_path(model_path, "model_path") if model_path else None)


async def create_sampling_session(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.CreateSamplingSession, state.json_limit)
    session = state.session(body.session_id, tenant)
    sampler_id = state.sampling_session(session, body.sampling_session_seq_id)
    if sampler_id is None:
        create = _create_body(body)
        state.count_creation(session, "sampling_session_seq_id")
        sampler = await state.service.samplers.create(create, tenant)
        sampler_id = sampler.sampler_id
        state.add_sampling_session(session, body.sampling_session_seq_id, sampler_id)
        state.add_session_sampler(session, sampler_id)
        state.journal.sampling_session(session, body.sampling_session_seq_id, sampler_id)
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


async def get_sampler(state: TinkerState, request: Request, tenant: str):
    sampler = state.service.samplers.get(request.path_params["sampler_id"], tenant)
    return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model,
            "model_path": to_tinker_path(sampler.model_path) if sampler.model_path else None}


def _stops(params: schemas.SamplingParams) -> tuple[list[str] | None, list[int] | None]:
    stop = params.stop
    if isinstance(stop, str):
        return [stop], None
    if stop is None:
        return None, None
    if not stop:
        return None, []  # no stops at all, not even EOS
    if isinstance(stop[0], str):
        return stop, None
    return None, stop


def sample_request(state: TinkerState, body: schemas.Asample, max_seq_len: int | None
                   ) -> tuple[SampleRequest, int | None, int]:
    if body.prompt is None:
        raise bad_request("prompt.chunks", "required: a list of chunks")
    tokens: list[int] = []
    images: list[WireImage] = []
    for i, chunk in enumerate(body.prompt.chunks):
        if chunk.type == "image":
            images.append(_image_chunk(chunk, len(tokens), f"prompt.chunks[{i}]"))
            continue
        if chunk.type != "encoded_text":
            raise bad_request(f"prompt.chunks[{i}]", f"{chunk.type[:60]!r} chunks are not supported (text and "
                                                     "inline image chunks are)")
        tokens.extend(chunk.tokens or [])
    if images and body.record_stability_info is True:
        raise bad_request("record_stability_info", "not taken for a prompt with image chunks")
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name):
            raise bad_request(name, "not supported by this worker")
    if body.target_prompt_logprobs is not None:
        raise bad_request("target_prompt_logprobs", "not supported by this worker")
    params = body.sampling_params or schemas.SamplingParams()
    max_tokens = params.max_tokens
    if max_tokens is None:
        room = (max_seq_len or DEFAULT_MAX_TOKENS + len(tokens)) - len(tokens)
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, state.service.limits.max_sample_tokens, room))
    stop_strings, stop_ids = _stops(params)
    last_n = body.prompt_logprobs_last_n
    want_prompt = bool(body.prompt_logprobs)
    if last_n is not None and (not want_prompt or not 1 <= last_n < len(tokens)):
        raise bad_request("prompt_logprobs_last_n", f"needs prompt_logprobs and must be in [1, {len(tokens) - 1}]")
    wire = SampleRequest(
        prompt_tokens=tokens, prompt_images=images or None, num_samples=body.num_samples,
        sampling_params=WireSamplingParams(
            max_tokens=max_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            seed=params.seed, stop=stop_strings, stop_token_ids=stop_ids),
        include_prompt_logprobs=want_prompt, topk_prompt_logprobs=body.topk_prompt_logprobs or 0,
        return_text=False,
    )
    return wire, last_n, wire.topk_prompt_logprobs


def _image_chunk(chunk: schemas.Chunk, position: int, where: str) -> WireImage:
    """A JSON image chunk (``{type: image, data: base64, format, expected_tokens?}``) as the service takes it."""
    if chunk.tokens is not None:
        raise bad_request(f"{where}.tokens", "an image chunk carries data, not tokens")
    if not chunk.data:
        raise bad_request(f"{where}.data", "required: the image's bytes in standard base64", code="invalid_image")
    try:
        image = ImageChunk(data=chunk.data, format=chunk.format, expected_tokens=chunk.expected_tokens)
    except ValidationError as exc:
        problem = first_error(exc)
        name = ".".join(str(p) for p in problem["loc"]) or "data"
        raise bad_request(f"{where}.{name}", problem["msg"], code="invalid_image") from None
    return WireImage(position=position, chunk=image)


async def _sampler_for(state: TinkerState, body: schemas.Asample, tenant: str) -> tuple[str, bool]:
    """The sampler an asample runs on, and whether it is one of the shared implicit ones."""
    if body.sampling_session_id is not None:
        return body.sampling_session_id, False
    return (await state.implicit.get(_create_body(body), tenant)).sampler_id, True


async def asample(state: TinkerState, request: Request, tenant: str):
    body, _ = await read(request, schemas.Asample, state.json_limit)
    body_digest = body.digest()
    service = state.service
    sampler_id, shared = await _sampler_for(state, body, tenant)
    sampler = service.samplers.get(sampler_id, tenant)
    seq_id = body.seq_id
    key = f"{sampler.sampler_id}:{seq_id}"
    dedupe = seq_id is not None and not shared  # shared samplers serve many clients: no seq_id of their own
    known = state.samples.get(key) if dedupe else None
    if known is not None:
        request_id, sequence_ids, seen = known
        if seen == body_digest:
            return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
    num = body.num_samples
    request_id = state.futures.new_id()
    count = num if 0 < num <= service.limits.max_num_samples else 0
    sequence_ids = [f"{request_id}:{i}" for i in range(count)]
    record = body.record_stability_info is True  # stable_reinforce: keep what each sequence was
    scope = state.sampler_session(sampler.sampler_id)
    try:
        if record and scope is None:
            raise bad_request("record_stability_info", provenance.NO_SESSION)
        host = await service.models.host(sampler.base_model)
        wire, last_n, topk = sample_request(state, body, host.max_seq_len)
        answer = {"protocol": "tinker", "include_prompt": wire.include_prompt_logprobs, "last_n": last_n,
                  "topk": topk, "dedupe": [key, sequence_ids, body_digest] if dedupe else None}

        def submit():
            return service.samplers.submit_async(sampler.sampler_id, wire, tenant, request_id=request_id,
                                                 front=answer)

        def recorded_and_encoded(result: dict) -> bytes:
            if record:
                provenance.record_samples(service.stability, tenant, scope, sampler.sampler_id, wire.prompt_tokens,
                                          sequence_ids, result["sequences"])
            return sample_answer(result, wire.include_prompt_logprobs, last_n, topk)

        async def convert(result: dict) -> bytes:
            return await asyncio.to_thread(recorded_and_encoded, result)

        try:
            job = await submit()
        except RateLimited as exc:  # over the key's token budget: accepted, held (paused) until it has room
            if state.rate_held[tenant] >= service.limits.max_queued_requests:
                raise  # as many held as may be queued: turned away, the client re-sends after Retry-After
            state.futures.add_guarded(tenant, _when_budget_allows(state, tenant, request_id, submit, exc, convert),
                                      request_id)
            state.futures.set_paused(request_id, exc.message)
            state.rate_held[tenant] += 1
        else:
            state.futures.add_guarded(tenant, job_result(job, convert), request_id)
    except WorkerError as exc:
        if exc.status == 429:  # backpressure: the client waits a moment and re-sends
            raise
        state.futures.add_guarded(tenant, raise_(exc), request_id)
    except Exception as exc:  # noqa: BLE001 - a bad request is a failed future
        state.futures.add_guarded(tenant, raise_(exc), request_id)
    if dedupe:
        state.samples.put(key, tenant, (request_id, sequence_ids, body_digest))  # this tenant's oldest go first
    return {"request_id": request_id, "sample_sequence_ids": sequence_ids}


async def _when_budget_allows(state: TinkerState, tenant: str, request_id: str, submit, refusal: RateLimited,
                              convert) -> bytes:
    """A sample request accepted over its key's token budget: it waits (its future paused) until the budget holds
    its cost, then is submitted and served like any other; never dropped."""
    try:
        while True:
            await state.service.budgets.ready(tenant, refusal.tokens)
            try:
                job = await submit()
            except RateLimited as again:  # another request of the key took the room first
                refusal = again
                state.futures.set_paused(request_id, again.message)
                continue
            break
    finally:
        state.rate_held[tenant] -= 1
        if state.rate_held[tenant] <= 0:
            del state.rate_held[tenant]
    state.futures.set_paused(request_id, None)
    return await job_result(job, convert)
