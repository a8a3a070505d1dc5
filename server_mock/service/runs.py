"""Training runs: create, look up, delete, and accept their ops in seq_id order.

A run belongs to one tenant; its ops go to the tenant's lane of the model queue (engine.py), so they
run in seq_id order while other tenants' requests interleave with them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pytrio_compat.wire import (
    Accepted,
    CreateTrainingRun,
    ForwardOp,
    LoadOp,
    LoraSpec,
    ModelOperationCapabilities,
    OptimStepOp,
    SaveOp,
    TrainingOp,
    TrainingRunInfo,
)
from server_mock.engine.requests import run_id
from server_mock.errors import WorkerError, bad_request, not_found
from server_mock.lora import Adapter
from server_mock.service.ops import PreparedOp, hash_and_prepare, op_digest, prepare_forward
from server_mock.service.quotas import check_queued
from server_mock.service.validation import check_adam
from server_mock.storage.checkpoints import check_name


@dataclass
class TrainingRun:
    run_id: str
    tenant: str
    base_model: str
    spec: LoraSpec
    adapter: Adapter
    last_seq: int = 0
    seqs: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq_id -> (request_id, body hash)
    admitting: asyncio.Lock = field(default_factory=asyncio.Lock)  # ops from the network, one at a time


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
        """Accept one training op in seq_id order. A resent seq_id returns the original request.
        Prepares the op here: for small ops; forward ops go through ``submit_op_off_loop``."""
        return self.submit_prepared(training_run_id, op.seq_id, op.payload, body_hash, tenant)

    async def submit_op_off_loop(self, training_run_id: str, op: TrainingOp, tenant: str) -> Accepted:
        """``submit_op`` for an op from the network: a forward op's digest and decoding run in a worker
        thread. A run's ops are admitted one at a time in arrival order, so each sees the seq_ids of the
        ones before it exactly as if it had been admitted at once."""
        run = self.get_run(training_run_id, tenant)
        async with run.admitting:
            if isinstance(op.payload, ForwardOp):
                body_hash, work = await asyncio.to_thread(
                    hash_and_prepare, op.payload, self.hosts[run.base_model], run.adapter, self.limits,
                    self.fault_injection)
            else:
                body_hash, work = op_digest(op.payload), op.payload
            return self.submit_prepared(training_run_id, op.seq_id, work, body_hash, tenant)

    def submit_prepared(self, training_run_id: str, seq_id: int, work, body_hash: str, tenant: str) -> Accepted:
        """Accept an op given as its payload, as a ``PreparedOp`` or as the error preparing it gave. The
        seq_id and queue checks come first: preparing (or its error) only counts for an op they let in."""
        run = self.get_run(training_run_id, tenant)
        if seq_id <= run.last_seq:
            request_id, seen_hash = run.seqs.get(seq_id, ("", ""))
            if seen_hash != body_hash:
                raise WorkerError(409, "seq_id_conflict", f"seq_id: {seq_id} was already used by a different "
                                                          "request on this run", "seq_id")
            return Accepted(request_id=request_id, duplicate=True)
        if seq_id != run.last_seq + 1:
            raise WorkerError(409, "seq_id_out_of_order",
                              f"seq_id: expected {run.last_seq + 1}, got {seq_id}", "seq_id")
        check_queued(self.requests, tenant, self.limits.max_queued_requests)
        if isinstance(work, BaseException):
            raise work
        prepared = work if isinstance(work, PreparedOp) else self._prepare(run, work)
        job = self.requests.new_job(prepared.kind, prepared.work, tenant)
        run.last_seq = seq_id
        run.seqs[seq_id] = (job.request_id, body_hash)
        if len(run.seqs) > 4096:
            run.seqs.pop(min(run.seqs))
        self.queues[run.base_model].put(job)
        return Accepted(request_id=job.request_id)

    def _prepare(self, run: TrainingRun, payload) -> PreparedOp:
        """The work for one op, validated now (a rejected op changes nothing), and its kind."""
        host = self.hosts[run.base_model]
        adapter = run.adapter
        if isinstance(payload, ForwardOp):
            return prepare_forward(payload, host, adapter, self.limits, self.fault_injection)
        if isinstance(payload, OptimStepOp):
            adam = check_adam(payload.adam_params)
            return PreparedOp("optim_step", lambda: {"metrics": host.optim_step(adapter, adam)})
        if isinstance(payload, SaveOp):
            check_name(payload.name)
            if payload.ttl_seconds is not None and payload.ttl_seconds <= 0:
                raise bad_request("ttl_seconds", "must be positive or null")
            return PreparedOp(payload.op, lambda: self._save(run, host, payload))
        if isinstance(payload, LoadOp):
            ref = self._owned_ref(payload.path, run.tenant, "path")  # reads only the small metadata file
            if ref.kind != "state":
                raise bad_request("path", "load_state needs a save_state checkpoint, not sampler weights")
            self._check_compatible(run, self.store.read_meta(ref))
            return PreparedOp("load_state", lambda: self._load(run, host, ref, payload.load_optimizer))
        raise bad_request("payload.op", "unknown operation")
