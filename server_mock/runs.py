"""Training runs: create, look up, delete, and accept their ops in seq_id order.

A run belongs to one tenant; its ops go to the tenant's lane of the model queue (engine.py), so they
run in seq_id order while other tenants' requests interleave with them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pytrio_compat.types import ModelOperationCapabilities
from pytrio_compat.types.tensor import WireTensor
from pytrio_compat.wire import (
    Accepted,
    CreateTrainingRun,
    ForwardOp,
    LoadOp,
    LoraSpec,
    OptimStepOp,
    SaveOp,
    TrainingOp,
    TrainingRunInfo,
)

from . import faults, losses
from .engine import run_id
from .errors import WorkerError, bad_request, not_found
from .quotas import check_queued
from .storage import check_name
from .training import Adapter
from .validation import check_adam, validate_data


@dataclass
class TrainingRun:
    run_id: str
    tenant: str
    base_model: str
    spec: LoraSpec
    adapter: Adapter
    last_seq: int = 0
    seqs: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq_id -> (request_id, body hash)


class RunsMixin:
    """Part of WorkerService: training runs and their ops."""

    def _check_lora(self, spec: LoraSpec) -> None:
        if not 1 <= spec.rank <= self.limits.max_lora_rank:
            raise bad_request("lora.rank", f"must be in [1, {self.limits.max_lora_rank}], got {spec.rank}")
        if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
            raise bad_request("lora", "at least one of train_mlp, train_attn, train_unembed must be true")

    def _check_run_quota(self, tenant: str) -> None:
        if sum(1 for r in self.runs.values() if r.tenant == tenant) >= self.limits.max_training_runs:
            raise WorkerError(429, "too_many_training_runs",
                              f"limit max_training_runs={self.limits.max_training_runs} reached; "
                              "delete runs or raise --max-training-runs")
        if len(self.runs) >= self.limits.max_adapters:
            raise WorkerError(429, "too_many_adapters",
                              f"limit max_adapters={self.limits.max_adapters} reached on this worker (all tenants); "
                              "retry later or raise --max-adapters")

    async def create_training_run(self, body: CreateTrainingRun, tenant: str) -> TrainingRunInfo:
        self._check_run_quota(tenant)
        meta = ref = None
        if body.from_checkpoint:
            ref = await asyncio.to_thread(self._owned_ref, body.from_checkpoint, tenant, "from_checkpoint")
            if ref.kind != "state":
                raise bad_request("from_checkpoint", "training needs a save_state checkpoint, got a sampler one")
            meta = await asyncio.to_thread(self.store.read_meta, ref)
            base_model, spec = meta["base_model"], LoraSpec.model_validate(meta["lora"])
            if body.base_model and body.base_model != base_model:
                raise bad_request("base_model",
                                  f"the checkpoint was trained on {base_model!r}, not {body.base_model!r}")
        else:
            if not body.base_model:
                raise bad_request("base_model", "required (or pass from_checkpoint)")
            base_model, spec = body.base_model, body.lora
        self._check_lora(spec)
        host = await self.host(base_model)
        new_id = run_id("run")

        def create() -> dict:  # on the model's thread: checkpoint files are read there, off the event loop
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

        # in the tenant's lane, so it runs after the run's ops already queued there
        await self.run_on_model(run.base_model, "delete_training_run", delete, tenant)

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
        check_queued(self.requests, tenant, self.limits.max_queued_requests)
        fn, kind = self._prepare(run, op.payload)
        job = self.requests.new_job(kind, fn, tenant)
        run.last_seq = op.seq_id
        run.seqs[op.seq_id] = (job.request_id, body_hash)
        if len(run.seqs) > 4096:
            run.seqs.pop(min(run.seqs))
        self.queues[run.base_model].put(job)
        return Accepted(request_id=job.request_id)

    def _prepare(self, run: TrainingRun, payload):
        """The work for one op, validated now (a rejected op changes nothing), and its kind."""
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
            data = validate_data(payload, host, self.limits)

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
            adam = check_adam(payload.adam_params)
            return (lambda: {"metrics": host.optim_step(adapter, adam)}), "optim_step"
        if isinstance(payload, SaveOp):
            check_name(payload.name)
            if payload.ttl_seconds is not None and payload.ttl_seconds <= 0:
                raise bad_request("ttl_seconds", "must be positive or null")
            return (lambda: self._save(run, host, payload)), payload.op
        if isinstance(payload, LoadOp):
            ref = self._owned_ref(payload.path, run.tenant, "path")  # reads only the small metadata file
            if ref.kind != "state":
                raise bad_request("path", "load_state needs a save_state checkpoint, not sampler weights")
            self._check_compatible(run, self.store.read_meta(ref))
            return (lambda: self._load(run, host, ref, payload.load_optimizer)), "load_state"
        raise bad_request("payload.op", "unknown operation")
