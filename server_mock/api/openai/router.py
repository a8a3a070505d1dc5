"""The OpenAI-compatible inference API: ``/api/openai/v1/{models, chat/completions, completions}``.

The same API keys and tenants as the native API (``Authorization: Bearer KEY``). ``model`` is a base
model the worker serves or a ``trio://`` sampler checkpoint the caller owns. Requests are sampled
through the service's queues (see serving.py); fields are checked in protocol.py and
answers are built in render.py. Errors have OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

``stream: true`` answers with server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``:
each token's text as the decode step that sampled it ends (streaming.py). With ``top_logprobs``, which a
teacher-forced pass computes once the answer is complete, the content chunks (one per token) come when it is.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from pytrio_compat.wire import ImageChunk
from pytrio_compat.wire import WireImage
from server_mock.api import bodies
from server_mock.api.auth import Auth
from server_mock.api.browser_safety import JSON, require_media_type
from server_mock.api.endpoint import endpoint
from server_mock.api.openai import render, streaming
from server_mock.api.openai.protocol import Generation, parse_chat, parse_completion
from server_mock.api.openai.serving import Generator
from server_mock.errors import WorkerError
from server_mock.service.worker import WorkerService

logger = logging.getLogger("server_mock")

PREFIX = "/api/openai/v1"
KEEPALIVE_SECONDS = 15.0  # an SSE comment after this long without an event (a streamed request waits in the queue)
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
          429: "rate_limit_error"}


def error_body(exc: WorkerError) -> dict:
    kind = _TYPES.get(exc.status, "server_error" if exc.status >= 500 else "invalid_request_error")
    return {"error": {"message": exc.message, "type": kind, "param": exc.field, "code": exc.code}}


def error_response(exc: WorkerError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


async def read_request(request: Request, limits, parse: Callable[[bytes], Generation]) -> Generation:
    """The JSON body, sent as ``application/json`` (as the openai client does: see browser_safety.py), within
    ``--max-json-body-bytes``, parsed and checked by ``parse`` (from the bytes): in a worker thread, within the
    parse budget, when large."""
    require_media_type(request, (JSON,), f"the body of {request.url.path.removeprefix(PREFIX)}")
    limit = bodies.json_limit(limits)
    raw = await bodies.read_body(request, limit)
    if not bodies.off_loop(raw):
        bodies.check_values(raw, limit)
        return parse(raw)
    async with bodies.parsing(request, await asyncio.to_thread(bodies.parse_cost, raw, limit)):
        return await asyncio.to_thread(parse, raw)


# --- models -----------------------------------------------------------------------------------------


def _model_entries(gen: Generator, tenant: str) -> list[dict]:
    service = gen.service
    started = int(service.started)
    data = [{"id": name, "object": "model", "created": started, "owned_by": "worker", "root": name, "parent": None}
            for name in gen.served_models()]
    for entry, meta in service.checkpoints.entries(tenant, None):  # in a worker thread: it reads the disk
        if entry.kind == "sampler":
            data.append({"id": entry.path, "object": "model", "created": int(entry.created_at), "owned_by": "you",
                         "root": entry.path, "parent": meta.get("base_model")})
    return data


async def list_models(gen: Generator, request: Request, tenant: str):
    return {"object": "list", "data": await asyncio.to_thread(_model_entries, gen, tenant)}


async def get_model(gen: Generator, request: Request, tenant: str):
    model = request.path_params["model"]
    for entry in await asyncio.to_thread(_model_entries, gen, tenant):
        if entry["id"] == model:
            return entry
    raise WorkerError(404, "model_not_found", f"model: {model!r} does not exist here", "model")


# --- generation ---------------------------------------------------------------------------------------


async def chat_completions(gen: Generator, request: Request, tenant: str):
    limits = gen.service.limits
    req = await read_request(request, limits, lambda body: parse_chat(body, limits.max_num_samples,
                                                                      limits.max_sample_tokens))
    sampler_id, host = await gen.resolve(req.model, tenant)
    prompt = render.render_chat(host.tokenizer, req.messages)
    images = None
    if req.images:
        if host.vision is None:
            raise WorkerError(400, "unsupported_parameter", f"messages: image_url parts need a vision-language "
                                                            f"model; {req.model} is text-only", "messages")
        prompt, placed = render.split_images(prompt, host.vision.marker_id, req.images)
        images = [WireImage(position=at, chunk=ImageChunk(data=data, format=fmt)) for at, data, fmt, _ in placed]
    queue, streams = streaming.channels(1, req.n) if _live(req) else (None, None)
    try:
        jobs = await gen.submit_all(sampler_id, host, [prompt], req, tenant, "messages", [images], streams)
    except WorkerError as exc:
        raise _image_part_error(exc, req) from None
    work = functools.partial(gen.choices, sampler_id, host, [prompt], jobs, req, tenant, "messages")
    # the prompt's length as the model reads it: with images, their tokens too (the checked request's)
    prompt_len = len(jobs[0].payload[0].prompt_tokens) if images else len(prompt)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                "system_fingerprint": None}
        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(req.n)]
        if streams is not None:
            return _live_stream("chat", head, first, gen, host, req, queue, streams, jobs, "messages", prompt_len)
        chunks = functools.partial(render.chat_chunks, host.tokenizer)
        return _stream(head, first, work, lambda c: chunks(c, req.logprobs, req.return_token_ids)[1:], req,
                       prompt_len)
    choices = await work()
    body = {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [render.chat_choice(host.tokenizer, c, req.logprobs, req.return_token_ids) for c in choices],
            "usage": render.usage(prompt_len, choices), "system_fingerprint": None}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt
    return body


def _image_part_error(exc: WorkerError, req: Generation) -> WorkerError:
    """A service error about ``prompt_images[k]...`` named by the content part that carried image k."""
    field_name = exc.field or ""
    if not field_name.startswith("prompt_images["):
        return exc
    k = int(field_name[len("prompt_images["):field_name.index("]")])
    prefix, to = f"prompt_images[{k}]", req.images[k][2]
    if field_name.startswith(prefix + ".chunk"):  # the chunk's data and format came in the part's data: URL
        rest = field_name[len(prefix + ".chunk"):]
        prefix, to = prefix + ".chunk" + rest, to + ".image_url" + (".url" if rest else "")
    part = to + field_name[len(prefix):]
    message = exc.message.replace(prefix, to)
    return WorkerError(exc.status, exc.code, message, part)


async def completions(gen: Generator, request: Request, tenant: str):
    limits = gen.service.limits
    req = await read_request(request, limits, lambda body: parse_completion(body, limits.max_num_samples,
                                                                            limits.max_sample_tokens))
    sampler_id, host = await gen.resolve(req.model, tenant)
    prompts = [render.encode_prompt(host.tokenizer, p) for p in req.prompts]
    queue, streams = streaming.channels(len(prompts), req.n) if _live(req) else (None, None)
    jobs = await gen.submit_all(sampler_id, host, prompts, req, tenant, "prompt", streams=streams)
    work = functools.partial(gen.choices, sampler_id, host, prompts, jobs, req, tenant, "prompt")
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
        if streams is not None:
            return _live_stream("completion", head, [], gen, host, req, queue, streams, jobs, "prompt", prompt_tokens)
        chunks = functools.partial(render.completion_chunks, host.tokenizer)
        return _stream(head, [], work, lambda c: chunks(c, req.logprobs, req.return_token_ids), req, prompt_tokens)
    choices = await work()
    body = {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [render.completion_choice(host.tokenizer, c, req.logprobs, req.return_token_ids)
                        for c in choices],
            "usage": render.usage(prompt_tokens, choices)}
    if req.return_token_ids:
        body["prompt_token_ids"] = prompts if len(prompts) > 1 else prompts[0]
    return body


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _live(req: Generation) -> bool:
    """Whether a request streams its tokens as they are decoded (top logprobs need the finished answer)."""
    return req.stream and not req.top_logprobs


def _live_stream(kind: str, head: dict, first: list[dict], gen: Generator, host, req: Generation, queue, streams,
                 jobs: list, prompt_field: str, prompt_tokens: int) -> StreamingResponse:
    events = streaming.live_events(kind, head, first, host.tokenizer, req, queue, streams,
                                   functools.partial(gen.results, jobs, req, prompt_field), gen.finisher(host, req),
                                   prompt_tokens, lambda: KEEPALIVE_SECONDS, error_body)
    return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)


def _stream(head: dict, first: list[dict], work, chunks_of, req: Generation, prompt_tokens: int) -> StreamingResponse:
    """Server-sent events once the answer is complete: ``first`` at once, then each choice's chunks (``work()``
    gives the choices), usage if asked, then ``[DONE]``."""
    usage_field = {"usage": None} if req.include_usage else {}

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    async def events():
        task = asyncio.ensure_future(work())
        try:
            for chunk in first:
                yield event({**head, "choices": [chunk], **usage_field})
            while not task.done():
                await asyncio.wait({task}, timeout=KEEPALIVE_SECONDS)
                if not task.done():
                    yield ": keep-alive\n\n"
            try:
                choices = task.result()
            except WorkerError as exc:
                yield event(error_body(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the client hears of it, in the stream
                logger.exception("openai: streamed request failed")
                yield event(error_body(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}")))
                return
            for choice in choices:
                for chunk in chunks_of(choice):
                    yield event({**head, "choices": [chunk], **usage_field})
            if req.include_usage:
                yield event({**head, "choices": [], "usage": render.usage(prompt_tokens, choices)})
            yield "data: [DONE]\n\n"
        finally:
            if not task.done():
                task.cancel()  # the client went away; the queued samples finish on their own

    return StreamingResponse(events(), media_type="text/event-stream", headers=_SSE_HEADERS)


async def unknown_endpoint(gen: Generator, request: Request, tenant: str):
    raise WorkerError(404, "unknown_url", f"{request.method} {request.url.path} is not an endpoint of this worker's "
                                          "OpenAI API (served: GET /models, POST /chat/completions, POST /completions)")


# --- routes -------------------------------------------------------------------------------------------


def openai_routes(service: WorkerService, auth: Auth) -> list[Route]:
    """The OpenAI-compatible routes, for the worker's Starlette app."""
    gen = Generator(service)

    def tenant_of(request: Request) -> str:
        try:
            return auth.tenant(request)
        except WorkerError as exc:
            if exc.status == 403:  # an operator key: refused as it is
                raise
            raise WorkerError(401, "invalid_api_key", exc.message) from None

    def route(path: str, handler, methods: list[str]) -> Route:
        run = functools.partial(handler, gen)
        return Route(PREFIX + path, endpoint(run, tenant_of=tenant_of, render_error=error_response, protocol="openai"),
                     methods=methods)

    return [
        route("/models", list_models, ["GET"]),
        route("/models/{model:path}", get_model, ["GET"]),
        route("/chat/completions", chat_completions, ["POST"]),
        route("/completions", completions, ["POST"]),
        route("/{rest:path}", unknown_endpoint, ["GET", "POST", "PUT", "PATCH", "DELETE"]),
    ]
