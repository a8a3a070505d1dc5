"""Training runs: create, look up, delete, and accept their ops in seq_id order.

A run belongs to one tenant; its ops go to the tenant's lane of the model queue (engine/queue.py), so they
run in seq_id order while other tenants' requests interleave with them. A front end that orders a run's ops
itself (Tinker's per-model gate) hands them over with ``seq_id=None``: next in order. With ``--durability full``
an op is recorded in the journal (service/journal.py) before it is queued, and its result before it is marked
finished. The journal's runs come back at start through service/restore.py, which makes each live again with
``reserve`` and ``adopt`` (or ``release`` when it fails) and queues its ops again with ``prepare`` and ``recorder``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pytrio_compat.wire import CreateTrainingRun, LoadOp, LoraSpec, OptimStepOp, SaveOp
from server_mock.config import Limits
from server_mock.engine.jobs import Job
from server_mock.engine.requests import RequestStore, run_id
from server_mock.errors import WorkerError, bad_request, not_found, storage_error
from server_mock.service.checkpoints import Checkpoints
from server_mock.service.models import Models
from server_mock.service.ops import ForwardBatch, PreparedOp, prepare_forward
from server_mock.lora import BYTES_PER_TRAINED_PARAM, adapter_parameters
from server_mock.service.quotas import ByteBudget, check_queued
from server_mock.service.rate_limits import TokenBudgets
from server_mock.service.validation import check_adam
from server_mock.service.journal import SEQS_REMEMBERED, STATE_OPS, Journal
from server_mock.storage import crash_points
from server_mock.storage.checkpoints import check_name, parse_path

RUN_ID_RE = re.compile(r"^run-[0-9a-f]{16,32}\Z")
FORWARD_OPS = ("forward", "forward_backward")  # their payloads stay journaled until the run's state is saved

# How each front end answers its ops, by protocol tag. An op is journaled with its front end's ``front``: data
# only (its "protocol" tag, the kind of answer and its fields), never the name of a Python function; the
# model-thread encoder of its result is what ``encoder_for(front)`` of that protocol gives (None: the result is
# left as it is), now and when the op is queued again after a restart (``register_front``).
Encoder = Callable[[dict], dict]
FRONTS: dict[str, Callable[[dict], Encoder | None]] = {}


def register_front(protocol: str, encoder_for: Callable[[dict], Encoder | None]) -> None:
    """Once per protocol: what encodes the result of an op that protocol journaled with ``front``."""
    FRONTS[protocol] = encoder_for


def encoder_for(front: dict | None) -> Encoder | None:
    """The model-thread encoder an op's ``front`` describes (None: no front, or its protocol encodes nothing)."""
    encoder_of = FRONTS.get(front.get("protocol", "")) if front else None
    return encoder_of(front) if encoder_of is not None else None


@dataclass
class TrainingRun:
    run_id: str
    tenant: str
    base_model: str
    spec: LoraSpec
    adapter: Any  # the host's adapter object
    user_metadata: dict[str, str] | None = None  # a front end's labels (Tinker create_model), kept in checkpoints
    last_seq: int = 0
    seqs: dict[int, tuple[str, str]] = field(default_factory=dict)  # seq_id -> (request_id, body hash)
    pending_forward: int = 0  # forward ops accepted since the last optim_step / load_state (--max-pending-forward-ops)
    admitting: asyncio.Lock = field(default_factory=asyncio.Lock)  # ops from the network, one at a time

    def count_op(self, kind: str) -> None:
        """An op of ``kind`` taken: a forward op counts against --max-pending-forward-ops, a state op (optim_step,
        load_state) starts the count again."""
        self.pending_forward = self.pending_forward + 1 if kind in FORWARD_OPS else 0 if kind in STATE_OPS else \
            self.pending_forward


def run_damaged(training_run_id: str, reason: str) -> WorkerError:
    return WorkerError(410, "training_run_damaged",
                       f"training_run: {training_run_id} could not be restored after the worker restarted: its record "
                       f"in the journal is damaged ({reason}); it was moved to the quarantine table of "
                       "durable/state.db. Start a new run from its last checkpoint", "training_run_id")


@dataclass(frozen=True)
class Admission:
    """An op accepted by ``Runs.submit``: its request, and its job (None for a resend whose job is gone)."""

    request_id: str
    job: Job | None
    duplicate: bool = False


Op = ForwardBatch | OptimStepOp | SaveOp | LoadOp


class Runs:
    def __init__(self, models: Models, requests: RequestStore, checkpoints: Checkpoints, limits: Limits,
                 fault_injection: bool, memory: ByteBudget | None = None, journal: Journal | None = None,
                 budgets: TokenBudgets | None = None) -> None:
        self.models = models
        self.budgets = budgets or TokenBudgets()  # --tokens-per-minute: a forward op costs its datums' tokens
        self.journal = journal  # --durability full: runs, ops and results recorded (service/journal.py)
        self.requests = requests
        self.checkpoints = checkpoints
        self.limits = limits
        self.fault_injection = fault_injection
        # adapter memory, estimated from the model's layout when a run is created
        self.memory = memory or ByteBudget(1 << 62, 1 << 62, "lora", "max_adapter_bytes", "max_adapter_bytes_total")
        self._runs: dict[str, TrainingRun] = {}
        # runs whose journal row could not be taken up at the last start: run id -> (tenant, why)
        self.damaged: dict[str, tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def check_spec(self, spec: LoraSpec, rank_field: str = "lora.rank", switches_field: str = "lora") -> None:
        """A LoRA layout this worker trains (400 naming the front end's field for the rank, or for the switches)."""
        if not 1 <= spec.rank <= self.limits.max_lora_rank:
            raise bad_request(rank_field, f"must be in [1, {self.limits.max_lora_rank}] (limit --max-lora-rank), "
                                          f"got {spec.rank}")
        if not (spec.train_mlp or spec.train_attn or spec.train_unembed):
            raise bad_request(switches_field, "at least one of train_mlp, train_attn, train_unembed must be true")

    def check_room(self, tenant: str, pending: int = 0, pending_all: int = 0) -> None:
        """Room for one more run of ``tenant``: 429 ``too_many_training_runs`` (per key) or ``too_many_adapters``
        (the worker). ``pending``/``pending_all``: runs a front end has promised (of this key / of all keys) whose
        adapters are not made yet."""
        if sum(1 for r in self._runs.values() if r.tenant == tenant) + pending >= self.limits.max_training_runs:
            raise WorkerError(429, "too_many_training_runs",
                              f"limit max_training_runs={self.limits.max_training_runs} reached; "
                              "delete runs or raise --max-training-runs")
        if len(self._runs) + pending_all >= self.limits.max_adapters:
            raise WorkerError(429, "too_many_adapters",
                              f"limit max_adapters={self.limits.max_adapters} reached on this worker (all tenants); "
                              "retry later or raise --max-adapters")

    async def create(self, body: CreateTrainingRun, tenant: str, new_id: str | None = None) -> TrainingRun:
        """A new run (``new_id``: its id, chosen by a front end that named the run before it existed; it must be
        unused and of the form run ids have, ``run-<hex>``)."""
        if new_id is not None and (new_id in self._runs or not RUN_ID_RE.match(new_id)):
            raise bad_request("training_run_id", f"{new_id!r} is taken or not a run id (run-<hex>)")
        self.check_room(tenant)
        meta = ref = None
        if body.from_checkpoint:
            meta = await asyncio.to_thread(self.checkpoints.state_meta, body.from_checkpoint, tenant,
                                           "from_checkpoint")
            ref = parse_path(body.from_checkpoint, "from_checkpoint")
            base_model, spec = meta["base_model"], LoraSpec.model_validate(meta["lora"])
            if body.base_model and body.base_model != base_model:
                raise bad_request("base_model",
                                  f"the checkpoint was trained on {base_model!r}, not {body.base_model!r}")
        else:
            if not body.base_model:
                raise bad_request("base_model", "required (or pass from_checkpoint)")
            base_model, spec = body.base_model, body.lora
        self.check_spec(spec)
        host = await self.models.host(base_model)
        new_id = new_id or run_id("run")
        size = await self.adapter_bytes(base_model, spec, tenant)
        self.check_room(tenant)  # again: other creates may have finished meanwhile
        self.memory.take(new_id, tenant, size, f"a rank-{spec.rank} adapter on {base_model} (its weights, gradients "
                                                f"and AdamW moments, {BYTES_PER_TRAINED_PARAM} bytes a parameter)")
        try:
            return await self._create(new_id, tenant, base_model, spec, host, meta, ref, body.load_optimizer)
        except BaseException:
            self.memory.give_back(new_id)
            raise

    async def adapter_bytes(self, base_model: str, spec: LoraSpec, tenant: str = "") -> int:
        """What a run's adapter of ``spec`` holds on ``base_model``: weights, gradients and AdamW moments."""
        layout = await self.models.lora_layout(base_model, tenant)
        host = self.models.loaded(base_model)
        return BYTES_PER_TRAINED_PARAM * adapter_parameters(layout, host.lora_targets(spec), spec.rank)

    async def _create(self, new_id: str, tenant: str, base_model: str, spec: LoraSpec, host, meta, ref,
                      load_optimizer: bool) -> TrainingRun:
        store = self.checkpoints.store
        made: list = []

        def create() -> dict:  # on the model's thread: checkpoint files are read there, off the event loop
            adapter = host.create_adapter(new_id, spec)
            if meta is not None:
                try:
                    host.load_adapter_weights(adapter, store.read_tensors(ref, "adapter_model.safetensors"))
                    state = store.read_tensors(ref, "optimizer.safetensors") if load_optimizer else None
                    host.load_optimizer_state(adapter, state)
                except BaseException:
                    host.drop_adapter(new_id)
                    raise
            if self.journal is not None:
                try:
                    self.journal.run_created(new_id, tenant, base_model,
                                             spec.model_copy(update={"seed": adapter.seed}).model_dump_json(),
                                             host, adapter)
                except BaseException as exc:
                    host.drop_adapter(new_id)
                    raise storage_error("create_training_run", exc) from exc
            made.append(adapter)
            return {"seed": adapter.seed}

        result = await self.models.run_on_model(base_model, "create_training_run", create, tenant)
        stored_spec = spec.model_copy(update={"seed": result["seed"]})
        run = TrainingRun(new_id, tenant, base_model, stored_spec, made[0])
        self._runs[new_id] = run
        return run

    def live(self) -> list[TrainingRun]:
        """Every live run (the operator's console)."""
        return list(self._runs.values())

    def owned(self, tenant: str) -> list[TrainingRun]:
        """This tenant's live runs."""
        return [run for run in self._runs.values() if run.tenant == tenant]

    def get(self, training_run_id: str, tenant: str) -> TrainingRun:
        run = self._runs.get(training_run_id)
        if run is None or run.tenant != tenant:
            damaged = self.damaged.get(training_run_id)
            if run is None and damaged is not None and damaged[0] == tenant:
                raise run_damaged(training_run_id, damaged[1])
            raise not_found("training_run", training_run_id)
        return run

    def set_damaged(self, training_run_id: str, tenant: str, reason: str) -> None:
        """A run whose journal row was set aside at start: its owner is told so (410) instead of 'unknown'."""
        self.damaged[training_run_id] = (tenant, reason)

    async def reserve(self, run_id: str, tenant: str, base_model: str, spec: LoraSpec, what: str) -> None:
        """Holds the memory of an adapter of ``spec`` for a run made outside ``create`` (one restored from the
        journal: the run quotas are not asked again), before its adapter is built; ``what``: how a refusal names it."""
        self.memory.take(run_id, tenant, await self.adapter_bytes(base_model, spec, tenant), what)

    def adopt(self, run: TrainingRun) -> None:
        """A run made outside ``create``, its memory held (``reserve``), is live from now on."""
        self._runs[run.run_id] = run

    def release(self, run_id: str) -> None:
        """The run is no longer live and its adapter's memory is given back (its adapter is the caller's to drop)."""
        self._runs.pop(run_id, None)
        self.memory.give_back(run_id)

    async def delete(self, training_run_id: str, tenant: str) -> None:
        run = self.get(training_run_id, tenant)
        host = self.models.loaded(run.base_model)
        self.release(training_run_id)
        if self.journal is not None:
            await asyncio.to_thread(self.journal.run_deleted, training_run_id)
        # in the tenant's lane, so it runs after the run's ops already queued there
        await self.models.run_on_model(run.base_model, "delete_training_run",
                                       lambda: host.drop_adapter(run.run_id) or {}, tenant)

    def prepare(self, run: TrainingRun, op: Op) -> PreparedOp:
        """The work for one op, validated now (a rejected op changes nothing), and its kind. A forward op reads
        all its arrays: call this in a worker thread for those."""
        host = self.models.loaded(run.base_model)
        adapter = run.adapter
        if isinstance(op, ForwardBatch):
            return prepare_forward(op, host, adapter, self.limits, self.fault_injection)
        record = {"op": type(op).__name__, "body": op.model_dump(mode="json")} if not isinstance(op, ForwardBatch) \
            else None
        if isinstance(op, OptimStepOp):
            adam = check_adam(op.adam_params)

            def step() -> dict:
                crash_points.reached("optim_step")
                return {"metrics": host.optim_step(adapter, adam)}

            return PreparedOp("optim_step", step, record=record)
        if isinstance(op, SaveOp):
            check_name(op.name)
            if op.ttl_seconds is not None and op.ttl_seconds <= 0:
                raise bad_request("ttl_seconds", "must be positive or null")
            return PreparedOp(op.op, lambda: self.checkpoints.save(run, host, op), record=record)
        if isinstance(op, LoadOp):
            meta = self.checkpoints.state_meta(op.path, run.tenant, "path")  # reads only the small metadata file
            self.checkpoints.check_layout(meta, run.spec, run.base_model, "path")
            ref = parse_path(op.path, "path")
            return PreparedOp("load_state", lambda: self.checkpoints.load(run, host, ref, op.load_optimizer),
                              record=record)
        raise bad_request("payload.op", "unknown operation")

    def export_op(self, training_run_id: str, tenant: str, name: str, ttl_seconds: int | None, layout,
                  recipients: list) -> PreparedOp:
        """The op that writes a run's current weights as external weights for download
        (``Checkpoints.save_export``), checked now; submit it like any other op so it runs in seq_id order."""
        run = self.get(training_run_id, tenant)
        check_name(name, "path")
        host = self.models.loaded(run.base_model)
        return PreparedOp("save_weights_external",
                          lambda: self.checkpoints.save_export(run, host, name, ttl_seconds, layout, recipients))

    def submit(self, training_run_id: str, work: PreparedOp | BaseException | Op, tenant: str, *,
               seq_id: int | None, body_hash: str = "", encode: Encoder | None = None,
               request_id: str | None = None, front: dict | None = None) -> Admission:
        """Accept one op of a run: ``seq_id`` must be the next one (a resent seq_id with the same body hash
        answers the original request; None: the next in order, for front ends that order ops themselves).

        ``work`` is the op, its ``PreparedOp``, or the error preparing it gave: the seq_id and queue checks come
        first, and preparing (or its error) only counts for an op they let in. ``front``: the front end's own fields
        (data: its protocol tag, its answer), journaled with the op (``OpRow.front`` after a restart); the result is
        converted to the caller's wire form on the model thread by ``encode``, by default what the protocol's
        ``encoder_for(front)`` gives, as it will be after a restart. ``request_id``: the id a front end chose for
        the request (Tinker: its future's id)."""
        run = self.get(training_run_id, tenant)
        if seq_id is None:
            seq_id = run.last_seq + 1
        if seq_id <= run.last_seq:
            request_id, seen_hash = run.seqs.get(seq_id, ("", ""))
            if seen_hash != body_hash:
                raise WorkerError(409, "seq_id_conflict", f"seq_id: {seq_id} was already used by a different "
                                                          "request on this run", "seq_id")
            return Admission(request_id, self.requests.get(request_id, tenant), duplicate=True)
        if seq_id != run.last_seq + 1:
            raise WorkerError(409, "seq_id_out_of_order",
                              f"seq_id: expected {run.last_seq + 1}, got {seq_id}", "seq_id")
        check_queued(self.requests, tenant, self.limits.max_queued_requests)
        if isinstance(work, BaseException):
            raise work
        prepared = work if isinstance(work, PreparedOp) else self.prepare(run, work)
        forward = prepared.kind in FORWARD_OPS
        if forward and run.pending_forward >= self.limits.max_pending_forward_ops:
            raise WorkerError(409, "too_many_pending_forward_ops",
                              f"{prepared.kind}: this run took {run.pending_forward} forward ops since its last "
                              f"optim_step (limit --max-pending-forward-ops={self.limits.max_pending_forward_ops}: "
                              "each is kept to run again after a restart); call optim_step before more")
        self.budgets.take(tenant, prepared.tokens)  # 429 + Retry-After past the key's tokens a minute
        job = self.requests.new_job(prepared.kind, prepared.work, tenant, request_id=request_id)
        job.encode = encode if encode is not None else encoder_for(front)
        job.tokens, job.scope = prepared.tokens, run.run_id
        job.open_steps = prepared.steps
        if self.journal is not None:
            try:
                room = self.checkpoints.room(tenant) if prepared.record is not None else None
                self.journal.op_accepted(run.run_id, seq_id, job.request_id, prepared.kind, body_hash,
                                         prepared.record, front, room)
            except Exception as exc:  # noqa: BLE001 - a full disk: the op is refused, nothing changed
                self.requests.discard(job.request_id)
                self.budgets.give_back(tenant, prepared.tokens)
                raise storage_error(prepared.kind, exc) from exc
            job.on_result = self.recorder(run, seq_id, prepared.kind)
        run.last_seq = seq_id
        run.count_op(prepared.kind)
        run.seqs[seq_id] = (job.request_id, body_hash)
        if len(run.seqs) > SEQS_REMEMBERED:
            run.seqs.pop(min(run.seqs))
        self.models.queue(run.base_model).put(job)
        return Admission(job.request_id, job)

    def recorder(self, run: TrainingRun, seq_id: int, kind: str) -> Callable:
        """What records an op's result on the model's thread (with the run's new state after optim_step and
        load_state), before the op is marked finished."""
        host = self.models.loaded(run.base_model)

        def record(job: Job, result: dict | None, error) -> None:
            changed = error is None and kind in STATE_OPS and run.run_id in self._runs
            self.journal.op_finished(run.run_id, seq_id, job, result, error, host, run.adapter if changed else None)

        return record

    async def submit_off_loop(self, training_run_id: str, tenant: str, seq_id: int,
                              prepare: Callable[[TrainingRun], tuple[str, PreparedOp | BaseException | Op]],
                              front: dict | None = None) -> Admission:
        """``submit`` for an op from the network whose decoding and checks are heavy: ``prepare(run)`` runs in a
        worker thread and gives (body hash, work). A run's ops are admitted one at a time in arrival order, so
        each sees the seq_ids of the ones before it exactly as if it had been admitted at once."""
        run = self.get(training_run_id, tenant)
        async with run.admitting:
            body_hash, work = await asyncio.to_thread(prepare, run)
            return self.submit(training_run_id, work, tenant, seq_id=seq_id, body_hash=body_hash, front=front)
