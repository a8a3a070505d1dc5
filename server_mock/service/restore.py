"""Training runs taken up again after a restart (``--durability full``): recovery at start (service/recovery.py)
replays each run's rows of the journal (service/journal.py) into the live runs (service/runs.py), so a worker
killed with ``kill -9`` resumes where it acknowledged.

A run comes back from its newest whole state file (its adapter's weights and AdamW moments); the forward_backward
ops acknowledged after that state run again (their gradients were pending), and the ops not yet finished are
queued again under their request ids, in seq_id order, each answered as the ``front`` journaled with it describes
(data: its protocol tag and answer kind, turned into an encoder by ``runs.encoder_for``). The replay enters the
live runs only through their declared methods: ``Runs.reserve`` (the adapter's memory), ``Runs.adopt`` (the run
is live), ``Runs.prepare`` (an op made ready again from its record), ``Runs.recorder`` (what journals its result)
and ``Runs.release`` (a run that could not be restored holds nothing).
"""

from __future__ import annotations

import logging

from pytrio_compat.wire import LoadOp, LoraSpec, OptimStepOp, SaveOp, WireImage
from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError, raising
from server_mock.service.journal import STATE_OPS, OpRow, RunRow, to_torch
from server_mock.service.ops import ForwardBatch, PreparedOp
from server_mock.service.runs import Op, TrainingRun, encoder_for
from server_mock.storage import records

logger = logging.getLogger("server_mock")

# Journals written before ``front`` described every encoded op named its encoder by its Python qualified name:
# read as the answer that name stood for (a record in that form is still taken up).
LEGACY_ENCODERS = {"server_mock.api.native.runs.encode_forward_result": {"protocol": "native", "answer": "forward"},
                   "server_mock.api.tinker.answers.encode_forward": {"protocol": "tinker", "answer": "forward"}}


def front_of(front: dict | None, record: dict) -> dict | None:
    """An op's ``front``, or (a journal of the earlier form) the one its record's encoder name stood for."""
    if front is None and record.get("encode"):
        return LEGACY_ENCODERS.get(record["encode"])
    return front


async def restore_run(service, row: RunRow, ops: list[OpRow]) -> TrainingRun | None:
    """A run of ``service`` (the ``WorkerService``) recorded before a restart, live again with its ops queued.
    None (logged) when no state file of it is whole; on any error nothing of it stays held and the error is raised
    (the caller sets the row aside, or keeps it for the next start)."""
    runs = service.runs
    loaded = service.journal.read_state(row)
    if loaded is None:
        logger.error("run %s cannot be restored: none of its state files is whole", row.run_id)
        return None
    state_seq, state = loaded
    spec = LoraSpec.model_validate_json(row.spec)
    host = await service.models.host(row.base_model)
    await runs.reserve(row.run_id, row.tenant, row.base_model, spec,
                       f"a rank-{spec.rank} adapter on {row.base_model} (restored)")
    try:
        run = await _rebuild(service.models, row, ops, spec, host, state_seq, state)
        runs.adopt(run)
        _requeue(service, run, ops, state_seq)
        return run
    except BaseException:  # nothing of it stays held: the caller sets the row aside
        runs.release(row.run_id)
        try:
            host.drop_adapter(row.run_id)  # at start: nothing else runs on the model yet
        except Exception:  # noqa: BLE001 - it was never made
            pass
        raise


async def _rebuild(models, row: RunRow, ops: list[OpRow], spec: LoraSpec, host, state_seq: int,
                   state: dict) -> TrainingRun:
    """The run as its state file and its ops' rows leave it: its adapter, the seq_ids it answered, its count of
    pending forward ops."""
    made: list = []

    def build() -> dict:
        adapter = host.create_adapter(row.run_id, spec)
        host.load_adapter_weights(adapter, to_torch(state["weights"]))
        host.load_optimizer_state(adapter, to_torch(state["optimizer"]))
        adapter.version = int(state["version"]) + 1
        made.append(adapter)
        return {}

    await models.run_on_model(row.base_model, "restore_training_run", build, row.tenant)
    run = TrainingRun(row.run_id, row.tenant, row.base_model, spec, made[0],
                      user_metadata=row.meta.get("user_metadata"))
    run.seqs = {op.seq: (op.request_id, op.body_hash) for op in ops}
    run.last_seq = max(run.seqs, default=0)
    for op in ops:  # the forward ops since its last state op count against --max-pending-forward-ops again
        if op.seq > state_seq:
            run.count_op(op.kind)
    return run


def _requeue(service, run: TrainingRun, ops: list[OpRow], state_seq: int) -> None:
    """The run's ops after its state, queued again in seq_id order: a finished forward_backward or state op for
    the state it leaves (its recorded result answers), an unfinished one under its request id."""
    queue = service.models.queue(run.base_model)
    for op in ops:
        if op.seq <= state_seq:
            continue
        if op.payload is None and op.kind not in ("forward_backward", *STATE_OPS):
            # an op that leaves the weights as they are and is not journaled to run again (an export)
            if not op.done:
                service.requests.restore(op.request_id, run.tenant, op.kind, None, WorkerError(
                    503, "interrupted", f"{op.kind}: the worker restarted while it ran; call it again"), 0.0)
            continue
        if op.payload is None:
            logger.error("run %s: op %d has no payload to run again; the run continues from seq_id %d",
                         run.run_id, op.seq, state_seq)
            break
        try:
            record = records.unpack(op.payload)
            kind = record["op"]
        except Exception as exc:  # noqa: BLE001 - a damaged payload: the ops after it cannot run in order
            logger.error("run %s: op %d's payload cannot be read (%s); the run continues from seq_id %d",
                         run.run_id, op.seq, exc, state_seq)
            break
        if kind == "SaveOp" and not op.done:  # it may have been written before the crash: again
            record["body"]["overwrite"] = True
        try:
            prepared = service.runs.prepare(run, _op_of(record))
        except WorkerError as exc:  # e.g. a checkpoint to load that is gone now
            prepared = PreparedOp(op.kind, raising(exc))
        except Exception as exc:  # noqa: BLE001 - a record that no longer validates: its poll gets why
            prepared = PreparedOp(op.kind, raising(WorkerError(
                500, "journal_damaged", f"{op.kind}: its journal record could not be read after a restart "
                                        f"({type(exc).__name__}); call it again")))
        if op.done:  # its result is recorded: run it again only for the state it leaves
            if op.kind in ("forward_backward", *STATE_OPS):
                queue.put(Job(f"replay-{op.request_id}", op.kind, prepared.work, owner=run.tenant))
            continue
        job = service.requests.new_job(prepared.kind, prepared.work, run.tenant, request_id=op.request_id)
        job.encode = encoder_for(front_of(op.front, record))
        job.on_result = service.runs.recorder(run, op.seq, prepared.kind)
        queue.put(job)


def _op_of(record: dict) -> Op:
    """The op an accepted op's journal record (``PreparedOp.record``, written by ``Runs.prepare`` and
    ``ops.prepare_forward``) describes."""
    kind = record["op"]
    if kind == "forward":
        images = record.get("images")
        if images is not None:
            images = [None if chunks is None else [WireImage.model_validate(c) for c in chunks]
                      for chunks in images]
        return ForwardBatch(record["loss_fn"], record["data"], record["backward"], record["loss_fn_config"],
                            record["loss_scale"], images)
    model = {"OptimStepOp": OptimStepOp, "SaveOp": SaveOp, "LoadOp": LoadOp}[kind]
    return model.model_validate(record["body"])
