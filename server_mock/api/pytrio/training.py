"""How each training event runs, through the service's runs (the same tenant lanes, limits, validation, prefix
sharing, losses and AdamW as the other protocols), and the answer it ends with.

The reduction (docs/pytrio.md): the engine's losses are per-token sums. The SDK splits one ``forward_backward``
call into events and sends the call's totals with each; an event's gradient is that of its summed loss times
``1 / max(1, total_active_tokens)``. Every event of a call uses the same factor, so the gradient is the call's
per-token mean however the SDK split it, and gradients add up across events and calls until ``optimize_step``.
Metrics are unscaled: ``loss_sum`` is the event's summed loss and ``token_count`` its active positions counted as
the SDK counts them, so the SDK's own ``loss_mean = sum(loss_sum) / sum(token_count)`` is that same mean.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from functools import partial

import numpy as np

from pytrio_compat.wire import AdamParams, CreateTrainingRun, LoraSpec, OptimStepOp, SaveOp
from server_mock.api.pytrio import event_wire as wire
from server_mock.api.pytrio.events import Event
from server_mock.api.pytrio.msgpack_codec import encode
from server_mock.api.pytrio.state import PytrioState, TrainingRun
from server_mock.engine.jobs import Job
from server_mock.errors import WorkerError
from server_mock.service.checkpoints import checkpoint_id
from server_mock.service.ops import ForwardBatch
from server_mock.storage import crash_points

IGNORE = wire.IGNORE_INDEX
DEFAULT_TEMPORARY_TTL = 21600  # what the SDK sends for save_weights_and_get_sampling_client


async def execute(state: PytrioState, run: TrainingRun, event: Event) -> None:
    """Start one admitted event (in index order); it ends when its service job does. An event that ends without
    one (refused, or a failed init) is recorded with its answer (``--durability full``)."""
    await _start(state, run, event)
    if event.finished and event.type != "trainer.end_run":
        await asyncio.to_thread(state.journal.event, run, event)  # off the event loop


async def _start(state: PytrioState, run: TrainingRun, event: Event) -> None:
    if event.type == "trainer.init_run":
        await _init(state, run, event)
        return
    if event.type == "trainer.end_run":
        event.finish(wire.succeeded(event.event_id, event.type, wire.EmptyResultOut(), wire.UsageOut()))
        state.spawn(state.release_training(run, "the client ended it"), f"releasing {run.cuid}")
        return
    if run.init != "ready":
        event.fail("run_not_initialized", "the run's trainer.init_run failed: send a new trainer.init_run first")
        return
    try:
        if event.type in ("trainer.forward", "trainer.forward_backward"):
            await _forward(state, run, event)
        elif event.type == "trainer.optimize_step":
            _optimize(state, run, event)
        else:
            _save(state, run, event)
    except WorkerError as exc:  # refused before it reached the model: changed nothing
        event.fail(exc.code, exc.message)


def front(run: TrainingRun, event: Event, answer: dict) -> dict:
    """What is journaled with the event's service op: the event, and what building its answer again needs."""
    return {"protocol": "pytrio", "run": run.cuid, "event_id": event.event_id, "type": event.type,
            "index": event.index, "digest": event.digest.hex(), "answer": answer}


def finisher(state: PytrioState, run: TrainingRun, event: Event,
             answer: dict) -> Callable[[Job], bytes | wire.EventStatusOut]:
    """What turns the event's finished service job into its answer. The answer is built on the model's thread
    (``encoder``); a job queued again after a restart has no encoder, and its answer is built here."""
    encoder = encoder_of(run, event, answer)
    usage = wire.UsageOut(**answer["usage"]) if "usage" in answer else None

    def finish(job: Job):
        if job.status == "succeeded" and job.result is not None and "answer" not in job.result:
            job.result = encoder(job.result)
        saved = job.status == "succeeded" and job.result and answer["kind"] == "save" and answer["in_memory"]
        if saved and job.result["path"] not in state.temporary:  # (already there: restored after a restart)
            state.keep_temporary(job.result["path"], run.tenant, run.session_cuid, float(answer["ttl"]))
        return _answer(event, job, usage)

    return finish


def encoder_of(run: TrainingRun, event: Event, answer: dict) -> Callable[[dict], dict]:
    """The model-thread encoder of an event's result, from what ``front`` recorded of it."""
    kind = answer["kind"]
    if kind == "forward":
        return partial(encode_forward, event.event_id, event.type, wire.ChunkCounts(**answer["counts"]),
                       answer["auto_shift"], wire.UsageOut(**answer["usage"]))
    if kind == "optim":
        return partial(_optim_answer, event.event_id, event.type)
    return partial(_save_answer, event.event_id, event.type, run.model_id)


def _handoff(state: PytrioState, run: TrainingRun, event: Event, work, answer: dict) -> None:
    """Queue the event's op on the service's run (journaled with ``front``) and end the event when it does."""
    admission = state.service.runs.submit(run.cuid, work, run.tenant, seq_id=None,
                                          encode=encoder_of(run, event, answer), front=front(run, event, answer))
    run.events.watch(event, admission.job, finisher(state, run, event, answer))


def _answer(event: Event, job: Job, usage: wire.UsageOut | None = None) -> bytes | wire.EventStatusOut:
    """A finished job's answer: the one its ``encode`` built on the model's thread, or its error."""
    if job.status == "succeeded" and job.result is not None and "answer" in job.result:
        return job.result["answer"]
    err = job.error
    code, message = (err.code, err.message) if err is not None else ("internal_error", f"{job.kind} failed")
    return wire.failed(event.event_id, event.type, code, message, usage)


# --- init_run -----------------------------------------------------------------------------------------------------


async def _init(state: PytrioState, run: TrainingRun, event: Event) -> None:
    payload: wire.InitRunIn = event.payload
    service, tenant = state.service, run.tenant
    crash_points.reached("init_run")  # (kill tests) acknowledged and recorded, no adapter yet
    lora = payload.lora_config
    spec = LoraSpec(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                    train_unembed=lora.train_unembed)
    try:
        if payload.checkpoint_uri:
            await asyncio.to_thread(_check_layout, state, payload.checkpoint_uri, tenant, spec)
            body = CreateTrainingRun(base_model=run.alias, from_checkpoint=payload.checkpoint_uri,
                                     load_optimizer=payload.load_optimizer)
        else:
            body = CreateTrainingRun(base_model=run.alias, lora=spec)
        made = await service.runs.create(body, tenant, new_id=run.cuid)
    except WorkerError as exc:
        run.init = "none"  # the SDK raises in the call that triggered init, and sends a new init_run next time
        await asyncio.to_thread(state.save_training, run)
        event.fail(exc.code, exc.message)
        return
    if state.training.get(run.cuid) is not run:  # released while its adapter was made
        await service.runs.delete(run.cuid, tenant)
        event.fail("run_released", "the training run was released while it was initialised")
        return
    run.init, run.status = "ready", "ACTIVE"
    run.lora = made.spec
    await asyncio.to_thread(state.save_training, run)
    event.finish(wire.succeeded(event.event_id, event.type, wire.EmptyResultOut(), wire.UsageOut()))


def _check_layout(state: PytrioState, uri: str, tenant: str, spec: LoraSpec) -> None:
    """A checkpoint loaded at init must be a save_state one with the LoRA layout the client asked for."""
    checkpoints = state.service.checkpoints
    checkpoints.check_layout(checkpoints.state_meta(uri, tenant, "checkpoint_uri"), spec, None, "lora_config")


# --- forward / forward_backward -----------------------------------------------------------------------------------


def _shifted(values: list | None, pad, dtype) -> np.ndarray | None:
    """auto_shift: position i scores label i+1 (the last position scores nothing)."""
    if values is None:
        return None
    array = np.asarray(values, dtype=dtype)
    return np.concatenate([array[1:], np.asarray([pad], dtype=dtype)])


def forward_batch(payload: wire.ForwardIn, backward: bool) -> ForwardBatch:
    """The event's datums as the service's numpy rows, with the reduction's scale (see the module docstring)."""
    rows = []
    shift = payload.auto_shift
    for datum in payload.data:
        row = {"tokens": np.asarray(datum.model_input.tokens(), dtype=np.int64)}
        inputs = {"target_tokens": (datum.target_ids, IGNORE, np.int64), "weights": (datum.weights, 0.0, np.float32),
                  "logprobs": (datum.logprobs, 0.0, np.float32), "advantages": (datum.advantages, 0.0, np.float32)}
        for name, (values, pad, dtype) in inputs.items():
            if values is not None:
                row[name] = _shifted(values, pad, dtype) if shift else np.asarray(values, dtype=dtype)
        rows.append(row)
    denominator = max(1, payload.gradient_accumulation.total_active_tokens)
    images = [datum.model_input.images() for datum in payload.data]
    return ForwardBatch(loss_fn=payload.loss.type, data=rows, backward=backward,
                        loss_fn_config=dict(payload.loss.config), loss_scale=1.0 / denominator if backward else 1.0,
                        images=images if any(images) else None)


def _unshift(array: np.ndarray) -> np.ndarray:
    """auto_shift output: entry j scores label j, as without it (entry 0 scores nothing)."""
    return np.concatenate([np.zeros(1, dtype=array.dtype), array[:-1]])


def encode_forward(event_id: str, event_type: str, counts: wire.ChunkCounts, auto_shift: bool, usage: wire.UsageOut,
                   result: dict) -> dict:
    """On the model's thread: the succeeded answer of a forward(_backward) event, as msgpack."""
    outputs = []
    for out in result["loss_fn_outputs"]:
        arrays = {k: (_unshift(v) if auto_shift else v) for k, v in out.items()
                  if k in ("logprobs", "elementwise_loss")}
        outputs.append({k: wire.wire_tensor(v.astype(np.float32)) for k, v in arrays.items()})
    loss_sum = float(result["metrics"]["loss_sum"])
    count = counts.active_tokens
    metrics = wire.ForwardMetricsOut(loss_sum=loss_sum, loss_mean=loss_sum / count if count else 0.0,
                                     token_count=count)
    answer = wire.succeeded(event_id, event_type, wire.ForwardResultOut(loss_fn_outputs=outputs, metrics=metrics),
                            usage)
    return {"answer": encode(answer)}


async def _forward(state: PytrioState, run: TrainingRun, event: Event) -> None:
    payload: wire.ForwardIn = event.payload
    runs = state.service.runs
    backward = event.type == "trainer.forward_backward"
    counts = payload.counts()
    usage = wire.UsageOut(input_tokens=counts.input_tokens, train_tokens=counts.input_tokens if backward else 0)
    service_run = runs.get(run.cuid, run.tenant)
    batch = forward_batch(payload, backward)
    event.payload = None  # the rows hold what the op needs
    try:
        prepared = await asyncio.to_thread(runs.prepare, service_run, batch)  # validated in full, off the loop
    except WorkerError as exc:
        event.fail(exc.code, exc.message, usage)
        return
    answer = {"kind": "forward", "counts": dataclasses.asdict(counts), "auto_shift": payload.auto_shift,
              "usage": usage.model_dump()}
    # over its key's --tokens-per-minute the event waits (the SDK cannot retry a refused event), then goes in at once
    await state.service.budgets.ready(run.tenant, prepared.tokens)
    _handoff(state, run, event, prepared, answer)


# --- optimize_step ------------------------------------------------------------------------------------------------


def _optim_answer(event_id: str, event_type: str, result: dict) -> dict:
    metrics = {k: float(v) for k, v in result.get("metrics", {}).items()  # (time/*: the queue's, not the step's)
               if isinstance(v, (int, float)) and np.isfinite(v) and not k.startswith("time/")}
    answer = wire.succeeded(event_id, event_type, wire.OptimResultOut(metrics=metrics), wire.UsageOut())
    return {"answer": encode(answer)}


def _optimize(state: PytrioState, run: TrainingRun, event: Event) -> None:
    payload: wire.OptimizeStepIn = event.payload
    op = OptimStepOp(adam_params=AdamParams(**payload.adam_params.model_dump()))
    _handoff(state, run, event, op, {"kind": "optim"})


# --- save_state / save_weights ------------------------------------------------------------------------------------


def _save(state: PytrioState, run: TrainingRun, event: Event) -> None:
    payload: wire.SaveIn = event.payload
    sampler = event.type == "trainer.save_weights"
    temporary = payload.visibility == "TEMPORARY"
    ttl = payload.ttl_seconds or (DEFAULT_TEMPORARY_TTL if temporary else None)
    # temporary sampler weights (save_weights_and_get_sampling_client, every GRPO step) stay in memory, per key
    # at most --max-snapshots of them, and expire at their TTL; everything else is written to disk
    in_memory = sampler and temporary
    op = SaveOp(op="save_weights_for_sampler" if sampler else "save_state", name=payload.name,
                ttl_seconds=None if in_memory else ttl, overwrite=payload.overwrite, ephemeral=in_memory)
    _handoff(state, run, event, op, {"kind": "save", "in_memory": in_memory, "ttl": ttl})


def _save_answer(event_id: str, event_type: str, model_id: str, result: dict) -> dict:
    checkpoint = wire.CheckpointResultOut(uri=result["path"], size_bytes=int(result["size"]), model_id=model_id,
                                          checkpoint_cuid=checkpoint_id(result["path"]))
    answer = wire.succeeded(event_id, event_type, wire.SaveResultOut(checkpoint=checkpoint), wire.UsageOut())
    return {"answer": encode(answer), "path": result["path"]}
