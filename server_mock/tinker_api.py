"""The Tinker HTTP API (``/api/v1/...``) on top of the worker's own service, for the official ``tinker`` SDK.

Everything here translates: Tinker requests become the service's ops, samplers and checkpoints, and
the service's results become Tinker's answers (JSON, or protobuf for forward/backward and sampling
results, see tinker_proto.py). Models, adapters, request queues and checkpoints are the service's, so
a run started through one protocol shares the worker with the other. See docs/tinker.md.

Identifiers:
  session       ``sess-<hex>``; a session's training models are deleted when it finishes
  model_id      ``<session_id>:train:<model_seq_id>`` (the client derives this form itself)
  request_id    ``tk-<hex>``, a future polled with ``retrieve_future``
  sampler       the service's sampler id is the ``sampling_session_id``
  paths         ``tinker://<run>/weights/<name>`` is the service's ``trio://<run>/state/<name>`` and
                ``tinker://<run>/sampler_weights/<name>`` its ``trio://<run>/sampler/<name>``
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pytrio_compat.types import AdamParams
from pytrio_compat.types.tensor import WireTensor
from pytrio_compat.wire import (
    CreateSampler,
    CreateTrainingRun,
    ForwardOp,
    LoadOp,
    LoraSpec,
    OptimStepOp,
    SampleRequest,
    SaveOp,
    TrainingOp,
    WireDatum,
    WireSamplingParams,
)

from . import tinker_proto as proto
from .errors import WorkerError, bad_request
from .tinker_futures import Futures, SeqGate, TinkerFailure, job_result

logger = logging.getLogger("server_mock")

LONG_POLL_SECONDS = 30.0  # retrieve_future holds a pending future this long (the client gives up at 45 s)
SESSION_TIMEOUT_SECONDS = 1800.0  # a session without heartbeats this long is finished (its models deleted)
DEFAULT_MAX_TOKENS = 256  # sampling_params.max_tokens when the client leaves it unset
PROTOBUF = "application/x-protobuf"
REDUCTIONS = {"mean", "sum", "min", "max", "slack", "hash2", "unique"}

_PATH_RE = re.compile(r"^tinker://(?P<run>[^/]+)/(?P<kind>weights|sampler_weights|external_weights)/(?P<name>[^/]+)$")
_TO_TRIO_KIND = {"weights": "state", "sampler_weights": "sampler"}
_TO_TINKER_KIND = {v: k for k, v in _TO_TRIO_KIND.items()}


# --- paths and metrics ------------------------------------------------------------------------------


def to_trio_path(path: str, field_name: str = "path") -> str:
    match = _PATH_RE.match(path or "")
    if not match:
        raise bad_request(field_name, f"{path!r} is not a checkpoint path: expected "
                                      "tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>",
                          code="invalid_checkpoint_path")
    if match["kind"] == "external_weights":
        raise bad_request(field_name, "external_weights paths are not supported by this worker",
                          code="invalid_checkpoint_path")
    return f"trio://{match['run']}/{_TO_TRIO_KIND[match['kind']]}/{match['name']}"


def to_tinker_path(path: str) -> str:
    match = re.match(r"^trio://(?P<run>[^/]+)/(?P<kind>state|sampler)/(?P<name>[^/]+)$", path or "")
    if not match:
        return path
    return f"tinker://{match['run']}/{_TO_TINKER_KIND[match['kind']]}/{match['name']}"


_TRIO_PATH_RE = re.compile(r"trio://(?P<run>[^/\s'\"]+)/(?P<kind>state|sampler)/(?P<name>[^/\s'\",;]+)")


def tinker_message(message: str, field_name: str | None = None) -> str:
    """A service message in Tinker's terms: tinker:// paths, and the field named once."""
    message = _TRIO_PATH_RE.sub(
        lambda m: f"tinker://{m['run']}/{_TO_TINKER_KIND[m['kind']]}/{m['name']}", message)
    if field_name and message.startswith(f"{field_name}: {field_name}: "):
        message = message[len(field_name) + 2:]
    return message


def tinker_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The service's forward metrics as Tinker's ``name:reduction`` keys (the client splits on the colon).

    ``loss:sum`` is the summed loss; ``token_count:sum`` the contributing positions. ``loss_mean`` is
    dropped: the client merges chunks by datum-weighted mean, which would not give a per-token mean.
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "token_count":
            out["token_count:sum"] = float(value)
        elif key.count(":") == 1 and key.split(":")[1] in REDUCTIONS:
            out[key] = float(value)
    if "loss:sum" not in out:
        out["loss:sum"] = float(metrics.get("loss_sum", 0.0))
    return out


# --- state ------------------------------------------------------------------------------------------


@dataclass
class Session:
    session_id: str
    tenant: str
    created: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.time)
    model_ids: list[str] = field(default_factory=list)


@dataclass
class TinkerModel:
    model_id: str
    run_id: str
    tenant: str
    session_id: str
    base_model: str
    gate: SeqGate


class TinkerState:
    def __init__(self, service) -> None:
        self.service = service
        self.futures = Futures()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TinkerModel] = {}
        self.creations: dict[tuple[str, int], tuple[str, str]] = {}  # (session, model_seq_id) -> (request, model)
        self.sampling_sessions: dict[tuple[str, int], str] = {}  # (session, sampling_session_seq_id) -> sampler
        self.samples: OrderedDict[tuple[str, int], tuple[str, list[str], str]] = OrderedDict()

    def session(self, session_id: str, tenant: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            raise WorkerError(404, "session_not_found", f"session_id: unknown session {session_id!r} "
                                                        "(the worker may have restarted)", "session_id")
        session.last_seen = time.time()
        return session

    def model(self, model_id: str, tenant: str) -> TinkerModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise WorkerError(404, "model_not_found", f"model_id: unknown model {model_id!r} (it was never created "
                                                      "here, its session finished, or the worker restarted)",
                              "model_id")
        return model

    async def register(self, session: Session, model_id: str, run_id: str, base_model: str) -> TinkerModel:
        if self.sessions.get(session.session_id) is not session:  # it finished while the model was made
            await self._delete_run(run_id, session.tenant)
            raise WorkerError(404, "session_not_found", f"session_id: session {session.session_id!r} has finished")
        model = TinkerModel(model_id, run_id, session.tenant, session.session_id, base_model, SeqGate())
        self.models[model_id] = model
        session.model_ids.append(model_id)
        return model

    async def finish(self, session: Session) -> None:
        """End a session: its training models are deleted (their checkpoints stay)."""
        self.sessions.pop(session.session_id, None)
        for key in [k for k in self.creations if k[0] == session.session_id]:
            del self.creations[key]
        for key in [k for k in self.sampling_sessions if k[0] == session.session_id]:
            del self.sampling_sessions[key]
        for model_id in session.model_ids:
            model = self.models.pop(model_id, None)
            if model is not None:
                await self._delete_run(model.run_id, session.tenant)

    async def expire(self) -> None:
        """Finish the sessions whose client stopped sending heartbeats (every 10 s while it runs)."""
        cutoff = time.time() - SESSION_TIMEOUT_SECONDS
        for session in [s for s in self.sessions.values() if s.last_seen < cutoff]:
            logger.info("tinker: session %s sent no heartbeat for %.0fs; finishing it", session.session_id,
                        SESSION_TIMEOUT_SECONDS)
            await self.finish(session)

    async def _delete_run(self, run_id: str, tenant: str) -> None:
        try:
            await self.service.delete_run(run_id, tenant)
        except WorkerError:
            pass


# --- HTTP plumbing ----------------------------------------------------------------------------------


class _KeyOnly:
    def __init__(self, key: str) -> None:
        self.headers = {"x-api-key": key}


def _tenant(auth, request: Request) -> str:
    """The worker's API keys, sent as ``X-API-Key`` by the tinker client. The client insists on a
    ``tml-`` prefix, so a worker key ``K`` is also accepted as ``tml-K``."""
    try:
        return auth.tenant(request)
    except WorkerError:
        key = request.headers.get("x-api-key", "")
        if key.startswith("tml-"):
            try:
                return auth.tenant(_KeyOnly(key[4:]))
            except WorkerError:
                pass
        raise WorkerError(401, "unauthorized", "missing or invalid API key: pass the worker's --api-key as "
                                               "api_key= (or TINKER_API_KEY); a key K also works as 'tml-K'") from None


def _error(exc: WorkerError) -> JSONResponse:
    # The tinker client re-sends on 408/409/429/5xx for minutes: answer final errors with a final status.
    status = exc.status
    if status == 409:
        status = 400
    elif status >= 500:
        status = 422
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse({"detail": tinker_message(exc.message, exc.field), "code": exc.code, "field": exc.field},
                        status_code=status, headers=headers)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise WorkerError(413, "body_too_large", f"body: {declared} bytes exceeds limit max_body_bytes={limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit}")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            import zstandard
        except ImportError:
            raise WorkerError(415, "unsupported_encoding",
                              "zstd bodies need the zstandard package on the worker") from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw)
        raw = reader.read(limit + 1)
        if len(raw) > limit:
            raise WorkerError(413, "body_too_large", f"body: exceeds limit max_body_bytes={limit} uncompressed")
    return raw


async def _json(request: Request, limit: int) -> dict:
    raw = await _body(request, limit)
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise WorkerError(400, "invalid_json", "body: not valid JSON") from None
    if not isinstance(body, dict):
        raise WorkerError(400, "invalid_json", "body: expected a JSON object")
    return body


def _field(body: dict, name: str, kind: type | tuple, required: bool = True, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(name, "required")
        return default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(name, f"must be an integer, got {value!r}")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise bad_request(name, f"has the wrong type ({type(value).__name__})")
    return value


def _digest(body: Any) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True).encode()
    return hashlib.sha256(raw).hexdigest()


def _failure(exc: BaseException) -> TinkerFailure:
    if isinstance(exc, TinkerFailure):
        return exc
    if isinstance(exc, WorkerError):
        failure = TinkerFailure.from_worker_error(exc)
        failure.message = tinker_message(failure.message, exc.field)
        return failure
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return TinkerFailure(f"{loc or 'request'}: {first.get('msg', 'invalid')}", "user")
    if isinstance(exc, proto.ProtoError):
        return TinkerFailure(f"malformed protobuf body: {exc}", "user")
    return TinkerFailure(f"{type(exc).__name__}: {exc}", "server")


# --- routes -----------------------------------------------------------------------------------------


def tinker_routes(service, auth) -> list[Route]:
    state = TinkerState(service)
    limit = service.limits.max_body_bytes

    def endpoint(handler: Callable[..., Awaitable[Any]], public: bool = False):
        async def wrapped(request: Request) -> Response:
            try:
                tenant = "" if public else _tenant(auth, request)
                result = await handler(request, tenant)
            except WorkerError as exc:
                return _error(exc)
            except Exception as exc:
                logger.exception("tinker: unhandled error in %s", request.url.path)
                return _error(WorkerError(500, "internal_error", f"{type(exc).__name__}: {exc}"))
            return result if isinstance(result, Response) else JSONResponse(result)

        return wrapped

    def failed(tenant: str, exc: BaseException) -> str:
        return state.futures.add_failed(tenant, _failure(exc))

    def guarded(tenant: str, work: Awaitable[Any]) -> str:
        return state.futures.add(tenant, _guard(work))

    # -- session ------------------------------------------------------------------------------------

    async def client_config(request: Request, tenant: str):
        # Defaults for everything else; JWT auth stays off (keys are checked on every request).
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False}

    async def dynamic_config(request: Request, tenant: str):
        return {}

    async def create_session(request: Request, tenant: str):
        await _json(request, limit)
        await state.expire()
        session = Session(f"sess-{uuid.uuid4().hex[:20]}", tenant)
        state.sessions[session.session_id] = session
        return {"session_id": session.session_id, "type": "create_session"}

    async def heartbeat(request: Request, tenant: str):
        body = await _json(request, limit)
        session = state.sessions.get(str(body.get("session_id")))
        if session is None or session.tenant != tenant:  # 410 tells the client to stop sending heartbeats
            raise WorkerError(410, "session_expired", "session_id: this session has finished or expired")
        session.last_seen = time.time()
        return {"type": "session_heartbeat"}

    async def telemetry(request: Request, tenant: str):
        await _body(request, limit)
        return {"status": "accepted"}

    async def finish_session(request: Request, tenant: str):
        await state.finish(state.session(request.path_params["session_id"], tenant))
        return {}

    async def capabilities(request: Request, tenant: str):
        return {"supported_models": [{"model_name": m.model_name, "max_context_length": m.max_context_length,
                                      "trainable": True, "sampleable": True} for m in service.capabilities()]}

    async def healthz(request: Request, tenant: str):
        return {"status": "ok"}

    # -- training models ----------------------------------------------------------------------------

    async def create_model(request: Request, tenant: str):
        body = await _json(request, limit)
        session = state.session(_field(body, "session_id", str), tenant)
        model_seq_id = _field(body, "model_seq_id", int)
        base_model = _field(body, "base_model", str)
        key = (session.session_id, model_seq_id)
        if key in state.creations:
            request_id, model_id = state.creations[key]
            return {"request_id": request_id, "model_id": model_id}
        model_id = f"{session.session_id}:train:{model_seq_id}"
        lora = _field(body, "lora_config", dict, required=False, default={})
        optimizer = _field(body, "optimizer_config", dict, required=False, default={})

        async def create() -> dict:
            if optimizer.get("type", "adamw") != "adamw":
                raise bad_request("optimizer_config.type", f"{optimizer.get('type')!r} is not supported; this "
                                                           "worker trains with adamw only")
            spec = LoraSpec(**{k: lora[k] for k in ("rank", "seed", "train_mlp", "train_attn", "train_unembed")
                               if lora.get(k) is not None})
            info = await service.create_training_run(CreateTrainingRun(base_model=base_model, lora=spec), tenant)
            await state.register(session, model_id, info.training_run_id, info.base_model)
            return {"model_id": model_id, "type": "create_model"}

        request_id = guarded(tenant, create())
        state.creations[key] = (request_id, model_id)
        return {"request_id": request_id, "model_id": model_id}

    async def get_info(request: Request, tenant: str):
        body = await _json(request, limit)
        model = state.model(_field(body, "model_id", str), tenant)
        run = service.get_run(model.run_id, tenant)
        host = service.hosts[run.base_model]
        source = Path(str(host.source_dir)).expanduser()
        # The client loads the tokenizer itself with AutoTokenizer.from_pretrained(tokenizer_id): a local
        # model folder works offline when the client runs on this machine; otherwise the hub id.
        tokenizer_id = str(source.resolve()) if source.is_dir() else str(host.source_dir)
        return {
            "type": "get_info", "model_id": model.model_id, "is_lora": True, "lora_rank": run.spec.rank,
            "model_name": run.base_model,
            "model_data": {"arch": getattr(host.model.config, "model_type", None), "model_name": run.base_model,
                           "tokenizer_id": tokenizer_id},
        }

    def submit_op(model: TinkerModel, tenant: str, payload, digest: str,
                  convert: Callable[[dict], Any] | None) -> Awaitable[Any]:
        """Hand one op to the service, after its predecessors; the awaitable of its result.

        An invalid op's awaitable raises its error. Only a full queue (429) raises here.
        """
        try:
            run = service.get_run(model.run_id, tenant)
            op = TrainingOp(seq_id=run.last_seq + 1, payload=payload() if callable(payload) else payload)
            accepted = service.submit_op(model.run_id, op, digest, tenant)
            job = service.requests.get(accepted.request_id, tenant)
        except WorkerError as exc:
            if exc.status == 429:
                raise
            return _raise(exc)
        except Exception as exc:  # noqa: BLE001
            return _raise(exc)
        return job_result(job, convert)

    def gated(tenant: str, model: TinkerModel, seq_id: Any, digest: str, payload,
              convert: Callable[[dict], Any] | None) -> dict:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise bad_request("seq_id", "required: an integer")
        request_id = model.gate.admit(
            seq_id, digest, lambda: submit_op(model, tenant, payload, digest, convert),
            lambda work: guarded(tenant, work),
            lambda message: failed(tenant, bad_request("seq_id", message, code="seq_id_conflict")))
        return {"request_id": request_id, "model_id": model.model_id}

    def forward_result(result: dict) -> bytes:
        outputs = [{k: WireTensor.model_validate(v).to_array() for k, v in o.items()}
                   for o in result.get("loss_fn_outputs", [])]
        return proto.encode_forward_backward_output(outputs, tinker_metrics(result.get("metrics", {})))

    async def forward_backward(request: Request, tenant: str):
        raw = await _body(request, limit)
        ctype = request.headers.get("content-type", "")
        if "protobuf" not in ctype and raw[:1] == b"{":
            raise WorkerError(415, "unsupported_media_type", "forward_backward takes a protobuf body "
                                                             "(application/x-protobuf), as tinker >= 0.25 sends")
        try:
            model_id, seq_id = proto.peek_ids(raw)
        except proto.ProtoError as exc:
            raise WorkerError(400, "invalid_protobuf", f"body: not a ForwardBackwardRequest: {exc}") from None
        model = state.model(model_id, tenant)

        def payload() -> ForwardOp:
            req = proto.decode_forward_backward_request(raw)
            data = [WireDatum(tokens=WireTensor.from_array(d.tokens),
                              loss_fn_inputs={k: WireTensor.from_array(v) for k, v in d.loss_fn_inputs.items()})
                    for d in req.data]
            return ForwardOp(op="forward" if req.forward_only else "forward_backward", loss_fn=req.loss_fn,
                             loss_fn_config=req.loss_fn_config, data=data)

        return gated(tenant, model, seq_id, _digest(raw), payload, forward_result)

    async def optim_step(request: Request, tenant: str):
        body = await _json(request, limit)
        model = state.model(_field(body, "model_id", str), tenant)

        def payload() -> OptimStepOp:
            params = body.get("adam_params") or body.get("optim_params")
            other = body.get("optimizer_params")
            if params is None and isinstance(other, dict) and other.get("type") not in (None, "adam", "adamw"):
                raise bad_request("optimizer_params.type", f"{other.get('type')!r} is not supported; this worker "
                                                           "trains with adamw only")
            params = params or other or {}
            if not isinstance(params, dict):
                raise bad_request("adam_params", "must be an object")
            known = AdamParams.model_fields
            return OptimStepOp(adam_params=AdamParams(**{k: v for k, v in params.items() if k in known}))

        def convert(result: dict) -> dict:
            m = result.get("metrics", {})
            metrics = {"grad_norm:mean": m.get("grad_norm"), "learning_rate:mean": m.get("learning_rate"),
                       "step:max": m.get("step")}
            return {"metrics": {k: float(v) for k, v in metrics.items() if v is not None}}

        return gated(tenant, model, body.get("seq_id"), _digest(body), payload, convert)

    async def save_weights(request: Request, tenant: str):
        body = await _json(request, limit)
        model = state.model(_field(body, "model_id", str), tenant)

        def payload() -> SaveOp:
            return SaveOp(op="save_state", name=body.get("path") or f"state-{uuid.uuid4().hex[:12]}",
                          ttl_seconds=body.get("ttl_seconds"), overwrite=bool(body.get("overwrite", False)))

        def convert(result: dict) -> dict:
            return {"path": to_tinker_path(result["path"]), "type": "save_weights"}

        return gated(tenant, model, body.get("seq_id"), _digest(body), payload, convert)

    async def save_weights_for_sampler(request: Request, tenant: str):
        body = await _json(request, limit)
        model = state.model(_field(body, "model_id", str), tenant)
        name = body.get("path")

        if name is not None:
            def payload() -> SaveOp:
                return SaveOp(op="save_weights_for_sampler", name=name, ttl_seconds=body.get("ttl_seconds"))

            def convert(result: dict) -> dict:
                return {"path": to_tinker_path(result["path"]), "type": "save_weights_for_sampler"}
        else:
            # save_weights_and_get_sampling_client: an in-memory snapshot and a sampler on it
            def payload() -> SaveOp:
                return SaveOp(op="save_weights_for_sampler", name=f"tinker-{uuid.uuid4().hex[:16]}", ephemeral=True)

            async def convert(result: dict) -> dict:
                info = await service.create_sampler(CreateSampler(model_path=result["path"]), tenant)
                return {"sampling_session_id": info.sampler_id, "type": "save_weights_for_sampler"}

        return gated(tenant, model, body.get("seq_id"), _digest(body), payload, convert)

    async def load_weights(request: Request, tenant: str):
        body = await _json(request, limit)
        path = _field(body, "path", str)
        with_optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is not None:  # load into an existing training model
            model = state.model(_field(body, "model_id", str), tenant)

            def payload() -> LoadOp:
                return LoadOp(path=to_trio_path(path), load_optimizer=with_optimizer)

            def convert(result: dict) -> dict:
                return {"path": path, "model_id": model.model_id, "type": "load_weights"}

            return gated(tenant, model, body.get("seq_id"), _digest(body), payload, convert)

        # create_training_client_from_state*: a new model whose first request is this load
        session = state.session(_field(body, "session_id", str), tenant)
        model_seq_id = _field(body, "model_seq_id", int)
        key = (session.session_id, model_seq_id)
        if key in state.creations:
            request_id, model_id = state.creations[key]
            return {"request_id": request_id, "model_id": model_id}
        model_id = f"{session.session_id}:train:{model_seq_id}"
        base_model = body.get("base_model")

        async def create() -> dict:
            create_body = CreateTrainingRun(base_model=base_model, from_checkpoint=to_trio_path(path),
                                            load_optimizer=with_optimizer)
            info = await service.create_training_run(create_body, tenant)
            await state.register(session, model_id, info.training_run_id, info.base_model)
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        request_id = guarded(tenant, create())
        state.creations[key] = (request_id, model_id)
        return {"request_id": request_id, "model_id": model_id}

    async def weights_info(request: Request, tenant: str):
        body = await _json(request, limit)
        config = service.checkpoint_config(to_trio_path(_field(body, "tinker_path", str), "tinker_path"), tenant)
        return {"base_model": config.base_model, "is_lora": True, "lora_rank": config.lora.rank,
                "train_unembed": config.lora.train_unembed, "train_mlp": config.lora.train_mlp,
                "train_attn": config.lora.train_attn}

    # -- sampling -----------------------------------------------------------------------------------

    async def create_sampling_session(request: Request, tenant: str):
        body = await _json(request, limit)
        session = state.session(_field(body, "session_id", str), tenant)
        seq = _field(body, "sampling_session_seq_id", int)
        key = (session.session_id, seq)
        if key not in state.sampling_sessions:
            model_path = body.get("model_path")
            create = CreateSampler(base_model=body.get("base_model"),
                                   model_path=to_trio_path(model_path, "model_path") if model_path else None)
            info = await service.create_sampler(create, tenant)
            state.sampling_sessions[key] = info.sampler_id
        return {"sampling_session_id": state.sampling_sessions[key], "type": "create_sampling_session"}

    async def get_sampler(request: Request, tenant: str):
        sampler = service.get_sampler(request.path_params["sampler_id"], tenant)
        return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model,
                "model_path": to_tinker_path(sampler.model_path) if sampler.model_path else None}

    def sample_request(body: dict, host) -> tuple[SampleRequest, int | None, int]:
        chunks = (body.get("prompt") or {}).get("chunks")
        if not isinstance(chunks, list):
            raise bad_request("prompt.chunks", "required: a list of chunks")
        tokens: list[int] = []
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
                kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
                raise bad_request(f"prompt.chunks[{i}]", f"{kind!r} chunks are not supported (text models only)")
            tokens.extend(chunk.get("tokens") or [])
        if body.get("topk_sample_logprobs"):
            raise bad_request("topk_sample_logprobs", "top-k logprobs of sampled tokens are not supported here")
        if body.get("target_prompt_logprobs") is not None:
            raise bad_request("target_prompt_logprobs", "not supported by this worker")
        if body.get("prompt_alt_tokens_k"):
            raise bad_request("prompt_alt_tokens_k", "not supported by this worker")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise bad_request("sampling_params", "must be an object")
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            room = (host.max_seq_len or DEFAULT_MAX_TOKENS + len(tokens)) - len(tokens)
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, service.limits.max_sample_tokens, room))
        stop = params.get("stop")
        stop_strings = stop_ids = None
        if isinstance(stop, str):
            stop_strings = [stop]
        elif isinstance(stop, list):
            if not stop:
                stop_ids = []  # no stops at all, not even EOS
            elif all(isinstance(s, str) for s in stop):
                stop_strings = stop
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                stop_ids = stop
            else:
                raise bad_request("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
        elif stop is not None:
            raise bad_request("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
        last_n = body.get("prompt_logprobs_last_n")
        want_prompt = bool(body.get("prompt_logprobs"))
        if last_n is not None and (not want_prompt or not isinstance(last_n, int) or not 1 <= last_n < len(tokens)):
            raise bad_request("prompt_logprobs_last_n", f"needs prompt_logprobs and must be in [1, {len(tokens) - 1}]")
        wire = SampleRequest(
            prompt_tokens=tokens, num_samples=body.get("num_samples", 1),
            sampling_params=WireSamplingParams(
                max_tokens=max_tokens, temperature=params.get("temperature", 1.0), top_k=params.get("top_k", -1),
                top_p=params.get("top_p", 1.0), seed=params.get("seed"), stop=stop_strings, stop_token_ids=stop_ids),
            include_prompt_logprobs=want_prompt, topk_prompt_logprobs=body.get("topk_prompt_logprobs") or 0,
            return_text=False,
        )
        return wire, last_n, wire.topk_prompt_logprobs

    async def asample(request: Request, tenant: str):
        body = await _json(request, limit)
        sampler_id = body.get("sampling_session_id")
        if sampler_id is None:  # the old addressing: a sampler per request
            model_path = body.get("model_path")
            create = CreateSampler(base_model=body.get("base_model"),
                                   model_path=to_trio_path(model_path, "model_path") if model_path else None)
            sampler_id = (await service.create_sampler(create, tenant)).sampler_id
        sampler = service.get_sampler(str(sampler_id), tenant)
        seq_id = body.get("seq_id")
        digest = _digest(body)
        key = (sampler.sampler_id, seq_id)
        if seq_id is not None and key in state.samples:
            request_id, sequence_ids, seen = state.samples[key]
            if seen == digest:
                return {"request_id": request_id, "sample_sequence_ids": sequence_ids}
        num = body.get("num_samples", 1)
        request_id = state.futures.new_id()
        sequence_ids = [f"{request_id}:{i}" for i in range(num if isinstance(num, int) and 0 < num <= 100_000 else 0)]
        try:
            wire, last_n, topk = sample_request(body, service.hosts[sampler.base_model])
            accepted = service.submit_sample(sampler.sampler_id, wire, tenant)
            job = service.requests.get(accepted.request_id, tenant)
        except WorkerError as exc:
            if exc.status == 429:  # backpressure: the client waits a moment and re-sends
                raise
            state.futures.add(tenant, _guard(_raise(exc)), request_id)
        except Exception as exc:  # noqa: BLE001 - a bad request is a failed future
            state.futures.add(tenant, _guard(_raise(exc)), request_id)
        else:
            def convert(result: dict) -> bytes:
                prompt_lps = None
                if wire.include_prompt_logprobs:
                    prompt_lps = list(result.get("prompt_logprobs") or [])
                    if last_n is not None:
                        cut = len(prompt_lps) - last_n
                        prompt_lps = [None] * cut + prompt_lps[cut:]
                tops = None
                if topk:
                    tops = list(result.get("topk_prompt_logprobs") or [])
                    if last_n is not None:
                        cut = len(tops) - last_n
                        tops = [None] * cut + tops[cut:]
                return proto.encode_sample_response(result["sequences"], prompt_lps, tops, topk)

            state.futures.add(tenant, _guard(job_result(job, convert)), request_id)
        if seq_id is not None:
            state.samples[key] = (request_id, sequence_ids, digest)
            while len(state.samples) > 20_000:
                state.samples.popitem(last=False)
        return {"request_id": request_id, "sample_sequence_ids": sequence_ids}

    # -- futures ------------------------------------------------------------------------------------

    async def retrieve_future(request: Request, tenant: str):
        body = await _json(request, limit)
        request_id = _field(body, "request_id", str)
        future = state.futures.get(request_id, tenant)
        if future is None:
            raise WorkerError(404, "request_not_found", f"request_id: unknown request {request_id!r} "
                                                        "(expired, or the worker restarted)", "request_id")
        await asyncio.wait({future.task}, timeout=LONG_POLL_SECONDS)
        if not future.task.done():
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        if future.task.cancelled():
            return {"error": "the request was dropped (too many pending requests)", "category": "server"}
        exc = future.task.exception()
        if exc is not None:
            failure = _failure(exc)
            return {"error": failure.message, "category": failure.category}
        result = future.task.result()
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return result

    async def unsupported(request: Request, tenant: str):
        raise WorkerError(404, "not_supported", f"{request.method} {request.url.path} is not supported by this "
                                                "worker (see docs/tinker.md for the Tinker endpoints it serves)")

    def route(path: str, handler, methods=("POST",), public: bool = False) -> Route:
        return Route("/api/v1" + path, endpoint(handler, public), methods=list(methods))

    return [
        route("/client/config", client_config),
        route("/client/dynamic_config", dynamic_config),
        route("/create_session", create_session),
        route("/session_heartbeat", heartbeat),
        route("/telemetry", telemetry),
        route("/sessions/{session_id}/finish", finish_session),
        route("/get_server_capabilities", capabilities, methods=("GET",)),
        route("/healthz", healthz, methods=("GET",), public=True),
        route("/create_model", create_model),
        route("/get_info", get_info),
        route("/forward_backward", forward_backward),
        route("/optim_step", optim_step),
        route("/save_weights", save_weights),
        route("/save_weights_for_sampler", save_weights_for_sampler),
        route("/load_weights", load_weights),
        route("/weights_info", weights_info),
        route("/create_sampling_session", create_sampling_session),
        route("/samplers/{sampler_id}", get_sampler, methods=("GET",)),
        route("/asample", asample),
        route("/retrieve_future", retrieve_future),
        route("/{rest:path}", unsupported, methods=("GET", "POST", "PUT", "PATCH", "DELETE")),
    ]


async def _raise(exc: BaseException) -> Any:
    raise exc


async def _guard(work: Awaitable[Any]) -> Any:
    """Every failure reaches the client as a failed future with a readable message."""
    try:
        return await work
    except Exception as exc:  # noqa: BLE001
        raise _failure(exc) from None
