"""HTTP routes: parse, authenticate, hand to the service, answer. No decisions are made here."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import uuid
from typing import Any, Awaitable, Callable

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pytrio_compat.types import GetServerCapabilitiesResponse
from pytrio_compat.wire import (
    CreateSampler,
    CreateTrainingRun,
    ErrorBody,
    ErrorResponse,
    SampleRequest,
    TokenizerFiles,
    TrainingOp,
)

from .errors import WorkerError
from .openai_api import openai_routes
from .service import WorkerService
from .tinker_api import tinker_routes

logger = logging.getLogger("server_mock")
MAX_POLL_SECONDS = 60.0


class Auth:
    """API keys, each a tenant. Compared in constant time; with no keys configured, everyone is one tenant."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys if k]

    def tenant(self, request: Request) -> str:
        if not self._keys:
            return "default"
        given = request.headers.get("x-api-key", "")
        auth = request.headers.get("authorization", "")
        if not given and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        candidate = given.encode()
        match = None
        for key in self._keys:  # no early exit: the time taken does not depend on which key matched
            if hmac.compare_digest(candidate, key):
                match = key
        if match is None:
            raise WorkerError(401, "unauthorized", "missing or invalid API key (send Authorization: Bearer KEY)")
        return "tenant-" + hashlib.sha256(match).hexdigest()[:16]


def error_response(exc: WorkerError, request_id: str) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message, field=exc.field))
    headers = {"x-request-id": request_id}
    if exc.status == 429:
        headers["Retry-After"] = "1"
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def _validation_to_worker_error(exc: PydanticValidationError) -> WorkerError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-"))
    return WorkerError(422, "invalid_request_body", f"{loc or 'body'}: {first.get('msg', 'invalid')}", loc or "body")


def create_app(service: WorkerService, api_keys: list[str] | None = None) -> Starlette:
    auth = Auth(api_keys or [])
    limits = service.limits

    def endpoint(handler: Callable[..., Awaitable[Any]], body_model: type[BaseModel] | None = None,
                 public: bool = False):
        async def wrapped(request: Request) -> Response:
            request_id = uuid.uuid4().hex[:12]
            try:
                tenant = "" if public else auth.tenant(request)
                kwargs: dict[str, Any] = {}
                if body_model is not None:
                    raw = await _read_body(request, limits.max_body_bytes)
                    try:
                        kwargs["body"] = body_model.model_validate_json(raw)
                    except PydanticValidationError as exc:
                        if _is_json_error(exc):
                            raise WorkerError(400, "invalid_json", "body: not valid JSON (or not UTF-8)",
                                              "body") from None
                        raise _validation_to_worker_error(exc) from None
                    kwargs["raw"] = raw
                result = await handler(request, tenant, **kwargs)
            except WorkerError as exc:
                return error_response(exc, request_id)
            except ClientDisconnect:  # the client went away mid-body: nothing was queued, nobody to answer
                logger.debug("client disconnected while sending %s", request.url.path)
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 - never a bare 500 without a message
                logger.exception("unhandled error in %s", request.url.path)
                return error_response(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}"), request_id)
            if isinstance(result, Response):
                return result
            payload = result.model_dump(mode="json") if isinstance(result, BaseModel) else result
            return JSONResponse(payload, headers={"x-request-id": request_id})

        return wrapped

    idempotent_results: dict[str, Any] = {}

    async def remember(request: Request, tenant: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """A create request resent with the same Idempotency-Key gets the first answer, not a second object."""
        key = request.headers.get("idempotency-key")
        key = f"{tenant}:{key}" if key else None  # one tenant's key never answers with another's object
        if key and key in idempotent_results:
            return idempotent_results[key]
        result = await make()
        if key:
            idempotent_results[key] = result
            if len(idempotent_results) > 4096:
                idempotent_results.pop(next(iter(idempotent_results)))
        return result

    async def health(request: Request, tenant: str):
        return {"status": "ok", "models_loaded": sorted(service.hosts)}

    async def whoami(request: Request, tenant: str):
        return {"tenant": tenant}

    async def capabilities(request: Request, tenant: str):
        return GetServerCapabilitiesResponse(supported_models=service.capabilities())

    async def tokenizer(request: Request, tenant: str):
        model = request.query_params.get("model", "")
        return TokenizerFiles(model=model, files=await service.tokenizer_files(model))

    async def create_run(request: Request, tenant: str, body: CreateTrainingRun, raw: bytes):
        return await remember(request, tenant, lambda: service.create_training_run(body, tenant))

    async def get_run(request: Request, tenant: str):
        run = service.get_run(request.path_params["run_id"], tenant)
        return service._run_info(run)

    async def delete_run(request: Request, tenant: str):
        await service.delete_run(request.path_params["run_id"], tenant)
        return {"deleted": True}

    async def submit_op(request: Request, tenant: str, body: TrainingOp, raw: bytes):
        digest = hashlib.sha256(body.payload.model_dump_json().encode()).hexdigest()
        return service.submit_op(request.path_params["run_id"], body, digest, tenant)

    async def checkpoint_config(request: Request, tenant: str):
        return service.checkpoint_config(request.query_params.get("path", ""), tenant)

    async def checkpoints(request: Request, tenant: str):
        if request.method == "DELETE":
            service.delete_checkpoint(request.query_params.get("path", ""), tenant)
            return {"deleted": True}
        return service.list_checkpoints(tenant, request.query_params.get("training_run_id") or None)

    async def create_sampler(request: Request, tenant: str, body: CreateSampler, raw: bytes):
        return await remember(request, tenant, lambda: service.create_sampler(body, tenant))

    async def get_sampler(request: Request, tenant: str):
        sampler = service.get_sampler(request.path_params["sampler_id"], tenant)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    async def sample(request: Request, tenant: str, body: SampleRequest, raw: bytes):
        return service.submit_sample(request.path_params["sampler_id"], body, tenant)

    async def get_request(request: Request, tenant: str):
        job = service.requests.get(request.path_params["request_id"], tenant)
        if job is None:
            raise WorkerError(404, "request_not_found",
                              f"unknown request {request.path_params['request_id']} (expired or worker restarted)")
        try:
            wait = min(float(request.query_params.get("wait", "0")), MAX_POLL_SECONDS)
        except ValueError:
            raise WorkerError(400, "invalid_query", "wait: must be a number of seconds", "wait") from None
        if not await _wait_unless_disconnected(request, service.requests.wait(job, max(wait, 0.0))):
            return Response(status_code=499)  # the poller went away; the request itself runs on regardless
        position = None
        if job.status == "queued":
            for q in service.queues.values():
                position = q.position(job.request_id)
                if position is not None:
                    break
        return job.to_status(position)

    routes = [
        Route("/v1/health", endpoint(health, public=True)),
        Route("/v1/whoami", endpoint(whoami)),
        Route("/v1/capabilities", endpoint(capabilities)),
        Route("/v1/tokenizer", endpoint(tokenizer)),
        Route("/v1/training_runs", endpoint(create_run, CreateTrainingRun), methods=["POST"]),
        Route("/v1/training_runs/{run_id}", endpoint(get_run), methods=["GET"]),
        Route("/v1/training_runs/{run_id}", endpoint(delete_run), methods=["DELETE"]),
        Route("/v1/training_runs/{run_id}/ops", endpoint(submit_op, TrainingOp), methods=["POST"]),
        Route("/v1/checkpoint_config", endpoint(checkpoint_config)),
        Route("/v1/checkpoints", endpoint(checkpoints), methods=["GET", "DELETE"]),
        Route("/v1/samplers", endpoint(create_sampler, CreateSampler), methods=["POST"]),
        Route("/v1/samplers/{sampler_id}", endpoint(get_sampler), methods=["GET"]),
        Route("/v1/samplers/{sampler_id}/sample", endpoint(sample, SampleRequest), methods=["POST"]),
        Route("/v1/requests/{request_id}", endpoint(get_request), methods=["GET"]),
    ]
    routes += tinker_routes(service, auth)
    routes += openai_routes(service, auth)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        sweep_every = max(0.05, min(60.0, service.requests.result_ttl / 2))  # results go within 1.5 x TTL

        async def sweeper() -> None:
            loop = asyncio.get_running_loop()
            last_disk_sweep = loop.time()
            while True:
                await asyncio.sleep(sweep_every)
                service.requests.sweep()
                if loop.time() - last_disk_sweep >= 60:
                    last_disk_sweep = loop.time()
                    await asyncio.to_thread(service.store.sweep_expired)

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()
            for q in service.queues.values():
                q.stop()

    return Starlette(routes=routes, lifespan=lifespan)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WorkerError(413, "body_too_large", f"body: {declared} bytes exceeds limit max_body_bytes={limit}", "body")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit}", "body")
        chunks.append(chunk)
    return b"".join(chunks)


async def _wait_unless_disconnected(request: Request, wait: Awaitable[None]) -> bool:
    """Run ``wait``; stop early (returning False) if the client disconnects meanwhile."""

    async def disconnected() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - cannot tell: just wait for the request
            await asyncio.Event().wait()

    waiter, watcher = asyncio.ensure_future(wait), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        watcher.cancel()
    return not (watcher.done() and not watcher.cancelled())


def _is_json_error(exc: PydanticValidationError) -> bool:
    return any(e.get("type") in ("json_invalid", "json_type") for e in exc.errors())


