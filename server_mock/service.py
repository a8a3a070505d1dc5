"""The worker's state and rules: models, training runs, samplers, snapshots and checkpoints.

Route handlers (app.py) only parse and answer; everything that decides lives here. Requests are
validated completely before they are queued, so a rejected request never touches an adapter.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import math
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pytrio_compat.types import AdamParams, ModelOperationCapabilities, SupportedModel
from pytrio_compat.types.tensor import WireTensor
from pytrio_compat.wire import (
    Accepted,
    CheckpointConfig,
    CheckpointEntry,
    CheckpointList,
    CreateSampler,
    CreateTrainingRun,
    ForwardOp,
    LoadOp,
    LoraSpec,
    OptimStepOp,
    SampleRequest,
    SamplerInfo,
    SaveOp,
    TrainingOp,
    TrainingRunInfo,
)

from . import faults, local_adapters, losses
from .engine import ModelQueue, RequestStore, run_id
from .errors import WorkerError, bad_request, not_found
from .sampling import SampleSpec, generate_batch
from .storage import CheckpointRef, CheckpointStore, check_name, parse_path
from .training import Adapter, ModelHost, Snapshot, TrainOptions

logger = logging.getLogger("server_mock")


@dataclass
class Limits:
    """Every limit is explicit; exceeding one is answered with 413/429 naming it."""

    max_body_bytes: int = 64 * 1024 * 1024
    max_seq_len: int = 8192
    max_tokens_per_request: int = 262_144
    max_sample_tokens: int = 8192
    max_num_samples: int = 256
    max_training_runs: int = 64  # per tenant
    max_adapters: int = 256  # training runs on the whole worker, all tenants together
    max_queued_requests: int = 1024  # per tenant: training ops and samples queued or running
    max_samplers: int = 1024
    max_snapshots: int = 16
    max_lora_rank: int = 128


@dataclass
class TrainingRun:
    run_id: str
    tenant: str
    base_model: str
    spec: LoraSpec
    adapter: Adapter
    last_seq: int = 0
    seqs: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq_id -> (request_id, body hash)


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    base_model: str
    model_path: str | None


class WorkerService:
    def __init__(self, models: dict[str, str], storage: str | Path, device: str, dtype: torch.dtype,
                 lazy_models: bool = False, limits: Limits | None = None, result_ttl: float = 3600.0,
                 allow_adapter_dirs: list[str] | None = None, fault_injection: bool | None = None,
                 train_options: TrainOptions | None = None) -> None:
        self.train_options = train_options or TrainOptions()
        self.model_sources = dict(models)
        # local PEFT adapter folders may be sampled from only inside these (real paths, symlinks resolved)
        self.allow_adapter_dirs = [os.path.realpath(d) for d in (allow_adapter_dirs or [])]
        self.fault_injection = faults.enabled_by_environment() if fault_injection is None else fault_injection
        self._layouts: dict[str, dict[str, local_adapters.Layer]] = {}
        self._local_snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.lazy_models = lazy_models
        self.device = device
        self.dtype = dtype
        self.limits = limits or Limits()
        self.store = CheckpointStore(storage)
        self.requests = RequestStore(result_ttl)
        self.hosts: dict[str, ModelHost] = {}
        self.queues: dict[str, ModelQueue] = {}
        self.runs: dict[str, TrainingRun] = {}
        self.samplers: OrderedDict[str, Sampler] = OrderedDict()
        self.snapshots: OrderedDict[str, tuple[str, Snapshot, str]] = OrderedDict()  # path -> (model, snapshot, tenant)
        self._load_locks: dict[str, asyncio.Lock] = {}
        self._tokenizer_files: dict[str, dict[str, str]] = {}
        self.started = time.time()

    # --- models ---------------------------------------------------------------------------------------

    def _source_for(self, name: str, field_name: str = "base_model") -> str:
        if name in self.model_sources:
            return self.model_sources[name]
        if self.lazy_models and name:
            return name
        served = ", ".join(sorted(self.model_sources)) or "none"
        raise WorkerError(404, "model_not_found", f"{field_name}: model {name!r} is not served here "
                                                  f"(served: {served}); start the worker with --model {name}=PATH",
                          field_name)

    async def host(self, name: str, field_name: str = "base_model") -> ModelHost:
        if name in self.hosts:
            return self.hosts[name]
        source = self._source_for(name, field_name)
        lock = self._load_locks.setdefault(name, asyncio.Lock())
        async with lock:
            if name not in self.hosts:
                logger.info("loading model %s from %s", name, source)
                try:
                    host = await asyncio.to_thread(ModelHost, name, source, self.device, self.dtype,
                                                   self.limits.max_seq_len, self.train_options)
                except WorkerError:  # e.g. model_not_supported: already says what is missing
                    raise
                except Exception as exc:  # noqa: BLE001 - report why the model could not load
                    raise WorkerError(404 if self.lazy_models else 500, "model_load_failed",
                                      f"{field_name}: could not load model {name!r}: {exc}", field_name) from exc
                self.queues[name] = ModelQueue(name, asyncio.get_running_loop())
                self.hosts[name] = host
        return self.hosts[name]

    async def run_on_model(self, model: str, kind: str, fn, owner: str = "") -> dict:
        """Queue work on a model's thread and wait for it (used for short control operations)."""
        job = self.requests.new_job(kind, fn, owner)
        self.queues[model].put(job)
        await job.done.wait()
        if job.status == "failed":
            err = job.error
            raise WorkerError(400 if err.field else 500, err.code, err.message, err.field)
        return job.result or {}

    def capabilities(self) -> list[SupportedModel]:
        names = sorted(set(self.model_sources) | set(self.hosts))
        out = []
        for name in names:
            host = self.hosts.get(name)
            max_len = host.max_seq_len if host else None
            limits = ModelOperationCapabilities(available=True, max_tokens_per_request=self.limits.max_tokens_per_request,
                                                max_seq_len=max_len)
            out.append(SupportedModel(model_name=name, max_context_length=max_len, training=limits, sampling=limits))
        return out

    async def tokenizer_files(self, model: str) -> dict[str, str]:
        host = await self.host(model, "model")
        if model not in self._tokenizer_files:
            with tempfile.TemporaryDirectory() as tmp:
                host.tokenizer.save_pretrained(tmp)
                self._tokenizer_files[model] = {
                    p.name: base64.b64encode(p.read_bytes()).decode("ascii") for p in Path(tmp).iterdir() if p.is_file()
                }
        return self._tokenizer_files[model]

    # --- training runs ----------------------------------------------------------------------------------

    def _check_lora(self, spec: LoraSpec) -> None:
        if not 1 <= spec.rank <= self.limits.max_lora_rank:
            raise bad_request("lora.rank", f"must be in [1, {self.limits.max_lora_rank}], got {spec.rank}")
        if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
            raise bad_request("lora", "at least one of train_mlp, train_attn, train_unembed must be true")

    async def create_training_run(self, body: CreateTrainingRun, tenant: str) -> TrainingRunInfo:
        tenant_runs = [r for r in self.runs.values() if r.tenant == tenant]
        if len(tenant_runs) >= self.limits.max_training_runs:
            raise WorkerError(429, "too_many_training_runs",
                              f"limit max_training_runs={self.limits.max_training_runs} reached; "
                              "delete runs or raise --max-training-runs")
        if len(self.runs) >= self.limits.max_adapters:
            raise WorkerError(429, "too_many_adapters",
                              f"limit max_adapters={self.limits.max_adapters} reached on this worker (all tenants); "
                              "retry later or raise --max-adapters")
        meta = None
        if body.from_checkpoint:
            ref = self._owned_ref(body.from_checkpoint, tenant, "from_checkpoint")
            meta = self.store.read_meta(ref)
            if ref.kind != "state":
                raise bad_request("from_checkpoint", "training needs a save_state checkpoint, got a sampler one")
            base_model, spec = meta["base_model"], LoraSpec.model_validate(meta["lora"])
            if body.base_model and body.base_model != base_model:
                raise bad_request("base_model", f"the checkpoint was trained on {base_model!r}, not {body.base_model!r}")
        else:
            if not body.base_model:
                raise bad_request("base_model", "required (or pass from_checkpoint)")
            base_model, spec = body.base_model, body.lora
        self._check_lora(spec)
        host = await self.host(base_model)
        new_id = run_id("run")

        def create() -> dict:
            adapter = host.create_adapter(new_id, spec)
            if meta is not None:
                try:
                    host.load_adapter_weights(adapter, self.store.read_tensors(ref, "adapter_model.safetensors"))
                    state = self.store.read_tensors(ref, "optimizer.safetensors") if body.load_optimizer else None
                    host.load_optimizer_state(adapter, state)
                except BaseException:
                    host.delete_adapter(new_id)
                    raise
            return {"seed": adapter.seed}

        result = await self.run_on_model(base_model, "create_training_run", create, tenant)
        stored_spec = spec.model_copy(update={"seed": result["seed"]})
        run = TrainingRun(new_id, tenant, base_model, stored_spec, host.adapters[new_id])
        self.runs[new_id] = run
        return self._run_info(run)

    def _run_info(self, run: TrainingRun) -> TrainingRunInfo:
        host = self.hosts[run.base_model]
        return TrainingRunInfo(
            training_run_id=run.run_id, base_model=run.base_model, lora=run.spec, vocab_size=host.vocab_size,
            limits=ModelOperationCapabilities(max_tokens_per_request=self.limits.max_tokens_per_request,
                                              max_seq_len=host.max_seq_len),
            last_seq_id=run.last_seq,
        )

    def get_run(self, training_run_id: str, tenant: str) -> TrainingRun:
        run = self.runs.get(training_run_id)
        if run is None or run.tenant != tenant:
            raise not_found("training_run", training_run_id)
        return run

    async def delete_run(self, training_run_id: str, tenant: str) -> None:
        run = self.get_run(training_run_id, tenant)
        host = self.hosts[run.base_model]
        del self.runs[training_run_id]

        def delete() -> dict:
            host.adapters.pop(run.run_id, None)
            for param in run.adapter.params.values():
                param.grad = None
            if host.peft is None:
                return {}
            names = list(host.peft.peft_config)
            unused = [name for name in names if name.startswith("run-") and name not in host.adapters]
            if len(unused) == len(names):
                # PEFT cannot drop its last adapter cleanly (disabling adapters, as base-model sampling does,
                # then fails on the missing name): one stays, unused, until another adapter exists
                unused = unused[1:]
            for name in unused:
                host.delete_adapter(name)
            return {}

        await self.run_on_model(run.base_model, "delete_training_run", delete)

    def submit_op(self, training_run_id: str, op: TrainingOp, body_hash: str, tenant: str) -> Accepted:
        """Accept one training op in seq_id order. A resent seq_id returns the original request."""
        run = self.get_run(training_run_id, tenant)
        if op.seq_id <= run.last_seq:
            request_id, seen_hash = run.seqs.get(op.seq_id, ("", ""))
            if seen_hash != body_hash:
                raise WorkerError(409, "seq_id_conflict", f"seq_id: {op.seq_id} was already used by a different "
                                                          "request on this run", "seq_id")
            return Accepted(request_id=request_id, duplicate=True)
        if op.seq_id != run.last_seq + 1:
            raise WorkerError(409, "seq_id_out_of_order",
                              f"seq_id: expected {run.last_seq + 1}, got {op.seq_id}", "seq_id")
        self._check_queued(tenant)
        fn, kind = self._prepare(run, op.payload)
        job = self.requests.new_job(kind, fn, tenant)
        run.last_seq = op.seq_id
        run.seqs[op.seq_id] = (job.request_id, body_hash)
        if len(run.seqs) > 4096:
            run.seqs.pop(min(run.seqs))
        self.queues[run.base_model].put(job)
        return Accepted(request_id=job.request_id)

    def _check_queued(self, tenant: str) -> None:
        limit = self.limits.max_queued_requests
        if self.requests.unfinished(tenant) >= limit:
            raise WorkerError(429, "too_many_queued_requests",
                              f"limit max_queued_requests={limit} reached: this API key has {limit} requests queued "
                              "or running; retry when some finish (or raise --max-queued-requests)")

    def _prepare(self, run: TrainingRun, payload):
        host = self.hosts[run.base_model]
        adapter = run.adapter
        if isinstance(payload, ForwardOp):
            loss_fn = payload.loss_fn
            backward = payload.op == "forward_backward"
            loss_config, fault = faults.split_config(payload.loss_fn_config, self.fault_injection, backward)
            try:
                config = losses.resolve_loss_config(loss_fn, loss_config)
            except losses.LossConfigError as exc:
                raise bad_request(exc.field, str(exc), code="invalid_loss") from None
            data = self._validate_data(payload, host)

            def run_forward() -> dict:
                with faults.injected(fault, list(adapter.params.values())):
                    out = host.forward_backward(adapter, data, loss_fn, config, backward)
                return {
                    "loss_fn_outputs": [{k: WireTensor.from_array(v).model_dump() for k, v in o.items()}
                                        for o in out["outputs"]],
                    "metrics": out["metrics"],
                }

            return run_forward, payload.op
        if isinstance(payload, OptimStepOp):
            adam = _check_adam(payload.adam_params)
            return (lambda: {"metrics": host.optim_step(adapter, adam)}), "optim_step"
        if isinstance(payload, SaveOp):
            check_name(payload.name)
            if payload.ttl_seconds is not None and payload.ttl_seconds <= 0:
                raise bad_request("ttl_seconds", "must be positive or null")
            return (lambda: self._save(run, host, payload)), payload.op
        if isinstance(payload, LoadOp):
            ref = self._owned_ref(payload.path, run.tenant, "path")
            if ref.kind != "state":
                raise bad_request("path", "load_state needs a save_state checkpoint, not sampler weights")
            meta = self.store.read_meta(ref)
            self._check_compatible(run, meta)
            return (lambda: self._load(run, host, ref, payload.load_optimizer)), "load_state"
        raise bad_request("payload.op", "unknown operation")

    def _validate_data(self, op: ForwardOp, host: ModelHost) -> list[dict[str, np.ndarray]]:
        if not op.data:
            raise bad_request("data", "training data cannot be empty")
        required = losses.REQUIRED_INPUTS[op.loss_fn]
        optional = losses.OPTIONAL_INPUTS[op.loss_fn]
        out = []
        total = 0
        for i, datum in enumerate(op.data):
            where = f"data[{i}]"
            tokens = _array(datum.tokens, f"{where}.tokens")
            if tokens.dtype != np.int64 or tokens.ndim != 1 or len(tokens) == 0:
                raise bad_request(f"{where}.tokens", "must be a non-empty 1-D int64 tensor")
            n = len(tokens)
            total += n
            if n > host.max_seq_len:
                raise WorkerError(413, "sequence_too_long", f"{where}.tokens: {n} tokens exceeds limit "
                                                            f"max_seq_len={host.max_seq_len}", f"{where}.tokens")
            _check_vocab(tokens, host.vocab_size, f"{where}.tokens", allow_ignore=False)
            row = {"tokens": tokens}
            for key in required + optional:
                if key not in datum.loss_fn_inputs:
                    if key in required:
                        raise bad_request(f"{where}.loss_fn_inputs.{key}",
                                          f"required by loss {op.loss_fn!r} (needs {', '.join(required)})")
                    continue
                value = _array(datum.loss_fn_inputs[key], f"{where}.loss_fn_inputs.{key}")
                if value.shape != (n,):
                    raise bad_request(f"{where}.loss_fn_inputs.{key}",
                                      f"must have shape [{n}] (the length of the tokens), got {list(value.shape)}")
                if key == "target_tokens":
                    if value.dtype != np.int64:
                        raise bad_request(f"{where}.loss_fn_inputs.{key}", "must be int64 token ids")
                    _check_vocab(value, host.vocab_size, f"{where}.loss_fn_inputs.{key}", allow_ignore=True)
                else:
                    value = value.astype(np.float32)
                    if not np.isfinite(value).all():
                        bad = int(np.flatnonzero(~np.isfinite(value))[0])
                        raise bad_request(f"{where}.loss_fn_inputs.{key}",
                                          f"must be finite; position {bad} is {value[bad]}")
                row[key] = value
            out.append(row)
        if total > self.limits.max_tokens_per_request:
            raise WorkerError(413, "request_too_large", f"data: {total} tokens exceeds limit "
                                                        f"max_tokens_per_request={self.limits.max_tokens_per_request}",
                              "data")
        return out

    def _save(self, run: TrainingRun, host: ModelHost, op: SaveOp) -> dict:
        adapter = run.adapter
        kind = "state" if op.op == "save_state" else "sampler"
        ref = CheckpointRef(run.run_id, kind, op.name)
        if kind == "sampler" and op.ephemeral:
            snap = host.snapshot(adapter)
            self._remember_snapshot(ref.path, run.base_model, snap, run.tenant)
            size = sum(t.numel() * t.element_size() for t in snap.tensors.values())
            return {"path": ref.path, "size": size, "model": run.base_model}
        meta = {"base_model": run.base_model, "lora": run.spec.model_dump(), "tenant": run.tenant,
                "optim_steps": adapter.optim_steps, "ttl_seconds": op.ttl_seconds, "kind": kind,
                "has_optimizer": kind == "state"}
        tensors = {"adapter_model.safetensors": host.adapter_weights(adapter)}
        if kind == "state":
            tensors["optimizer.safetensors"] = host.optimizer_state(adapter)
        files = {"adapter_config.json": host.peft_adapter_config(run.spec)}
        size = self.store.write(ref, meta, tensors, files, overwrite=op.overwrite)
        if kind == "sampler":
            self.snapshots.pop(ref.path, None)  # a re-save must not serve the old weights
        return {"path": ref.path, "size": size, "model": run.base_model}

    def _load(self, run: TrainingRun, host: ModelHost, ref: CheckpointRef, with_optimizer: bool) -> dict:
        weights = self.store.read_tensors(ref, "adapter_model.safetensors")
        state = self.store.read_tensors(ref, "optimizer.safetensors") if with_optimizer else None
        before = host.adapter_weights(run.adapter)
        try:
            host.load_adapter_weights(run.adapter, weights)
            host.load_optimizer_state(run.adapter, state)
        except BaseException:
            host.load_adapter_weights(run.adapter, before)
            raise
        return {}

    def _check_compatible(self, run: TrainingRun, meta: dict) -> None:
        spec = LoraSpec.model_validate(meta["lora"])
        mismatches = [f for f in ("rank", "train_mlp", "train_attn", "train_unembed")
                      if getattr(spec, f) != getattr(run.spec, f)]
        if meta["base_model"] != run.base_model:
            mismatches.insert(0, "base_model")
        if mismatches:
            raise bad_request("path", f"checkpoint does not match this training client in: {', '.join(mismatches)}",
                              code="checkpoint_config_mismatch")

    def _owned_ref(self, path: str, tenant: str, field_name: str) -> CheckpointRef:
        ref = parse_path(path, field_name)
        if path in self.snapshots:
            if self.snapshots[path][2] != tenant:
                raise WorkerError(404, "checkpoint_not_found", f"{field_name}: no checkpoint at {path}", field_name)
            return ref
        meta_tenant = None
        if self.store.exists(ref):
            meta_tenant = self.store.read_meta(ref).get("tenant", "")
        if meta_tenant is None or meta_tenant != tenant:
            # 404, not 403: another tenant's checkpoints must not even be seen to exist
            raise WorkerError(404, "checkpoint_not_found", f"{field_name}: no checkpoint at {path}", field_name)
        return ref

    def checkpoint_config(self, path: str, tenant: str) -> CheckpointConfig:
        ref = self._owned_ref(path, tenant, "path")
        meta = self.store.read_meta(ref)
        return CheckpointConfig(path=path, kind=ref.kind, base_model=meta["base_model"],
                                lora=LoraSpec.model_validate(meta["lora"]), has_optimizer=meta.get("has_optimizer", False))

    def list_checkpoints(self, tenant: str, training_run_id: str | None) -> CheckpointList:
        entries = []
        for ref, meta, size in self.store.list(training_run_id):
            if meta.get("tenant", "") != tenant:
                continue
            entries.append(CheckpointEntry(checkpoint_id=hashlib.sha256(ref.path.encode()).hexdigest()[:16],
                                           kind=ref.kind, path=ref.path, created_at=meta.get("created_at", 0.0),
                                           size_bytes=size))
        return CheckpointList(checkpoints=entries)

    def delete_checkpoint(self, path_or_id: str, tenant: str) -> None:
        if not path_or_id.startswith("trio://"):
            matches = [c.path for c in self.list_checkpoints(tenant, None).checkpoints if c.checkpoint_id == path_or_id]
            if not matches:
                raise not_found("checkpoint", path_or_id)
            path_or_id = matches[0]
        ref = self._owned_ref(path_or_id, tenant, "path")
        self.store.delete(ref)
        self.snapshots.pop(ref.path, None)

    # --- sampling ---------------------------------------------------------------------------------------

    def _remember_snapshot(self, path: str, base_model: str, snap: Snapshot, tenant: str) -> None:
        self.snapshots[path] = (base_model, snap, tenant)
        self.snapshots.move_to_end(path)
        while len(self.snapshots) > self.limits.max_snapshots:
            self.snapshots.popitem(last=False)

    async def create_sampler(self, body: CreateSampler, tenant: str) -> SamplerInfo:
        base_model = body.base_model
        if body.model_path and local_adapters.is_local_path(body.model_path):
            return await self._create_local_sampler(body, tenant)
        if body.model_path:
            ref = self._owned_ref(body.model_path, tenant, "model_path")
            if body.model_path in self.snapshots:
                ckpt_model = self.snapshots[body.model_path][0]
            else:
                ckpt_model = self.store.read_meta(ref)["base_model"]
            if base_model and base_model != ckpt_model:
                raise bad_request("base_model", f"{body.model_path} was trained on {ckpt_model!r}, not {base_model!r}")
            base_model = ckpt_model
        if not base_model:
            raise bad_request("base_model", "required when model_path is not given")
        await self.host(base_model)
        sampler = Sampler(run_id("sampler"), tenant, base_model, body.model_path)
        self.samplers[sampler.sampler_id] = sampler
        while len(self.samplers) > self.limits.max_samplers:
            self.samplers.popitem(last=False)
        return SamplerInfo(sampler_id=sampler.sampler_id, base_model=base_model, model_path=body.model_path)

    async def _create_local_sampler(self, body: CreateSampler, tenant: str) -> SamplerInfo:
        folder = local_adapters.resolve(body.model_path, self.allow_adapter_dirs)
        base_model = body.base_model
        if not base_model:
            hint = local_adapters.base_model_hint(folder)
            if hint not in self.model_sources and hint not in self.hosts:
                raise bad_request("base_model", f"required for a local adapter folder ({folder} names base model "
                                                f"{hint!r}, which this worker does not serve)")
            base_model = hint
        host = await self.host(base_model)
        if base_model not in self._layouts:
            layout = await self.run_on_model(base_model, "adapter_layout",
                                             lambda: {"layout": local_adapters.model_layout(host)}, tenant)
            self._layouts[base_model] = layout["layout"]
        await asyncio.to_thread(self._local_snapshot, str(folder), host, base_model)  # check it now, once
        sampler = Sampler(run_id("sampler"), tenant, base_model, str(folder))
        self.samplers[sampler.sampler_id] = sampler
        while len(self.samplers) > self.limits.max_samplers:
            self.samplers.popitem(last=False)
        return SamplerInfo(sampler_id=sampler.sampler_id, base_model=base_model, model_path=body.model_path)

    def _local_snapshot(self, path: str, host: ModelHost, base_model: str) -> Snapshot:
        folder = local_adapters.resolve(path, self.allow_adapter_dirs)
        key = f"{base_model}:{local_adapters.fingerprint(folder)}"
        if key not in self._local_snapshots:
            self._local_snapshots[key] = local_adapters.load(folder, host, self._layouts[base_model],
                                                             self.limits.max_lora_rank)
            while len(self._local_snapshots) > self.limits.max_snapshots:
                self._local_snapshots.popitem(last=False)
        self._local_snapshots.move_to_end(key)
        return self._local_snapshots[key]

    def get_sampler(self, sampler_id: str, tenant: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            raise not_found("sampler", sampler_id)
        return sampler

    def _snapshot_for(self, sampler: Sampler, host: ModelHost) -> Snapshot | None:
        if sampler.model_path is None:
            return None
        if local_adapters.is_local_path(sampler.model_path):
            return self._local_snapshot(sampler.model_path, host, sampler.base_model)
        if sampler.model_path in self.snapshots:
            self.snapshots.move_to_end(sampler.model_path)
            return self.snapshots[sampler.model_path][1]
        ref = parse_path(sampler.model_path, "model_path")
        if not self.store.exists(ref):
            raise WorkerError(404, "sampler_weights_expired",
                              f"model_path: the weights {sampler.model_path} are gone (in-memory snapshots are kept for "
                              f"the {self.limits.max_snapshots} most recent); save them with a name to keep them",
                              "model_path")
        meta = self.store.read_meta(ref)
        spec = LoraSpec.model_validate(meta["lora"])
        tensors = self.store.read_tensors(ref, "adapter_model.safetensors")
        _, targets = host._lora_config(spec)
        snap = Snapshot(hashlib.sha256(ref.path.encode()).hexdigest()[:16], spec, targets, tensors)
        self._remember_snapshot(sampler.model_path, sampler.base_model, snap, sampler.tenant)
        return snap

    def submit_sample(self, sampler_id: str, request: SampleRequest, tenant: str) -> Accepted:
        sampler = self.get_sampler(sampler_id, tenant)
        self._check_queued(tenant)
        host = self.hosts[sampler.base_model]
        spec = self._validate_sample(request, host)
        snapshot = self._snapshot_for(sampler, host)
        return_text = request.return_text

        def run_sample() -> dict:
            return self._sample_batch(host, snapshot, [(spec, return_text)])[0]

        job = self.requests.new_job("sample", run_sample, tenant)
        job.batch_key = f"{sampler.base_model}:{snapshot.snapshot_id if snapshot else 'base'}"
        job.payload = (spec, return_text)
        job.batch_fn = lambda payloads: self._sample_batch(host, snapshot, payloads)
        job.batch_cost = spec.num_samples * (len(spec.prompt_tokens) + spec.max_tokens)
        self.queues[sampler.base_model].put(job)
        return Accepted(request_id=job.request_id)

    @staticmethod
    def _sample_batch(host: ModelHost, snapshot: Snapshot | None, payloads: list[tuple[SampleSpec, bool]]) -> list[dict]:
        """Run one or more sample requests for the same weights as one decoding batch."""
        started = time.perf_counter()
        model = host.sampling_model(snapshot)
        loaded = time.perf_counter()
        timings: dict[str, float] = {}
        results = generate_batch(model, [spec for spec, _ in payloads], host.tokenizer, timings,
                                 host.sampling_support)
        out = []
        for (spec, return_text), result in zip(payloads, results):
            sequences = [
                {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs,
                 "text": host.tokenizer.decode(s.tokens, skip_special_tokens=True) if return_text else None}
                for s in result.sequences
            ]
            out.append({
                "sequences": sequences,
                "prompt_logprobs": result.prompt_logprobs or [],
                "topk_prompt_logprobs": result.topk_prompt_logprobs or [],
                "input_tokens": len(spec.prompt_tokens),
                "output_tokens": sum(len(s.tokens) for s in result.sequences),
                "metrics": {"batch_requests": float(len(payloads)), "time/load_weights": loaded - started,
                            "time/prefill": timings.get("prefill", 0.0), "time/decode": timings.get("decode", 0.0)},
            })
        return out

    def _validate_sample(self, request: SampleRequest, host: ModelHost) -> SampleSpec:
        params = request.sampling_params
        prompt = np.asarray(request.prompt_tokens, dtype=np.int64)
        if len(prompt) == 0:
            raise bad_request("prompt_tokens", "prompt cannot be empty")
        _check_vocab(prompt, host.vocab_size, "prompt_tokens", allow_ignore=False)
        if not 1 <= request.num_samples <= self.limits.max_num_samples:
            raise WorkerError(413 if request.num_samples > 0 else 400, "invalid_num_samples",
                              f"num_samples: must be in [1, {self.limits.max_num_samples}] (limit max_num_samples), "
                              f"got {request.num_samples}", "num_samples")
        if not 1 <= params.max_tokens <= self.limits.max_sample_tokens:
            raise WorkerError(413 if params.max_tokens > 0 else 400, "invalid_max_tokens",
                              f"sampling_params.max_tokens: must be in [1, {self.limits.max_sample_tokens}] "
                              f"(limit max_sample_tokens), got {params.max_tokens}", "sampling_params.max_tokens")
        if len(prompt) + params.max_tokens > host.max_seq_len:
            raise WorkerError(413, "sequence_too_long",
                              f"sampling_params.max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                              f"exceeds max_seq_len={host.max_seq_len}", "sampling_params.max_tokens")
        if not math.isfinite(params.temperature) or params.temperature < 0:
            raise bad_request("sampling_params.temperature", f"must be a finite number >= 0, got {params.temperature}")
        if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
            raise bad_request("sampling_params.top_p", f"must be in (0, 1], got {params.top_p}")
        if params.top_k < -1:
            raise bad_request("sampling_params.top_k", f"must be -1 (off) or >= 0, got {params.top_k}")
        if not 0 <= request.topk_prompt_logprobs <= 20:
            raise bad_request("topk_prompt_logprobs", f"must be in [0, 20], got {request.topk_prompt_logprobs}")
        if params.stop_token_ids is not None:
            _check_vocab(np.asarray(params.stop_token_ids, dtype=np.int64), host.vocab_size,
                         "sampling_params.stop_token_ids", allow_ignore=False)
            stop_ids = list(params.stop_token_ids)
        else:
            stop_ids = _default_stop_ids(host)
        stop_strings = [s for s in (params.stop or []) if s]
        if params.stop is not None and len(stop_strings) != len(params.stop):
            raise bad_request("sampling_params.stop", "stop strings must be non-empty")
        if stop_strings and params.stop_token_ids is None:
            stop_ids = _default_stop_ids(host)
        return SampleSpec(
            prompt_tokens=prompt.tolist(), num_samples=request.num_samples, max_tokens=params.max_tokens,
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
            stop_token_ids=stop_ids, stop_strings=stop_strings,
            include_prompt_logprobs=request.include_prompt_logprobs,
            topk_prompt_logprobs=request.topk_prompt_logprobs,
        )


def _default_stop_ids(host: ModelHost) -> list[int]:
    """EOS of the tokenizer and of the generation config (stop=None means: stop at end of turn)."""
    ids = set()
    if host.tokenizer.eos_token_id is not None:
        ids.add(int(host.tokenizer.eos_token_id))
    gen_eos = getattr(getattr(host.model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, (list, tuple)):
        ids.update(int(x) for x in gen_eos)
    return sorted(ids)


def _array(tensor: WireTensor, field_name: str) -> np.ndarray:
    try:
        return tensor.to_array()
    except ValueError as exc:
        raise bad_request(field_name, str(exc)) from None


def _check_vocab(ids: np.ndarray, vocab_size: int, field_name: str, allow_ignore: bool) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if allow_ignore:
        bad &= ids != losses.IGNORE_INDEX
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        raise bad_request(field_name, f"token id {int(ids[pos])} at position {pos} is outside the vocabulary "
                                      f"[0, {vocab_size})" + (" (use -100 to ignore a position)" if allow_ignore else ""),
                          code="token_id_out_of_range")


def _check_adam(adam: AdamParams) -> AdamParams:
    checks = [
        ("learning_rate", adam.learning_rate >= 0, ">= 0"),
        ("beta1", 0 <= adam.beta1 < 1, "in [0, 1)"),
        ("beta2", 0 <= adam.beta2 < 1, "in [0, 1)"),
        ("eps", adam.eps > 0, "> 0"),
        ("weight_decay", adam.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", adam.grad_clip_norm >= 0, ">= 0 (0 disables clipping)"),
    ]
    for name, ok, want in checks:
        value = getattr(adam, name)
        if not math.isfinite(value) or not ok:
            raise bad_request(f"adam_params.{name}", f"must be finite and {want}, got {value}")
    return adam
