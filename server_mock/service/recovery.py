"""Recovery at start (``--durability full``): a worker started on existing storage takes up what the journal
(service/journal.py) recorded, before it serves its first request.

In order: files a crash left half written or unnamed are deleted; finished requests within their TTL answer polls
again; in-memory sampler snapshots and samplers come back; each training run is rebuilt from its newest whole
state file, the forward_backward ops acknowledged after it run again (their gradients were pending), and its ops
not yet finished are queued again under their request ids, in seq_id order; sample requests in flight are queued
again under theirs. A client polling a request it was given before the crash gets its answer; a client resending
an op the crash kept it from seeing acknowledged gets the original request back (its seq_id and body hash are
recorded), so the op runs once. Last, each front end's hook (``service.recovery_hooks``) rebuilds its own state
(the Tinker protocol's sessions, models, seq_id gates and futures) from its records and the ops above.
"""

from __future__ import annotations

import logging
import time

from pytrio_compat.wire import LoraSpec, SampleRequest
from server_mock.engine.queue import Job
from server_mock.errors import WorkerError
from server_mock.lora import Snapshot
from server_mock.service.journal import to_torch

logger = logging.getLogger("server_mock")


async def recover(service) -> dict[str, int]:
    """Restore what ``service.journal`` holds; how many of each thing came back (and the seconds it took)."""
    journal = service.journal
    if journal is None:
        return {}
    started = time.perf_counter()
    counts = {"orphans_removed": journal.collect_orphans() + service.store.remove_leftovers(), "requests": 0,
              "snapshots": 0, "samplers": 0, "runs": 0, "samples_requeued": 0}
    now = time.time()
    for rid, tenant, kind, _status, result, error, finished in journal.finished_requests():
        err = None if error is None else WorkerError(error["status"], error["code"], error["message"], error["field"])
        service.requests.restore(rid, tenant, kind, result, err, now - finished)
        counts["requests"] += 1
    for path, tenant, base_model, data in journal.snapshots():
        if data is None:
            logger.warning("sampler snapshot %s: its file is missing or torn; it is gone", path)
            journal.snapshot_dropped(path)
            continue
        spec = LoraSpec.model_validate_json(data["spec"])
        snap = Snapshot(data["snapshot_id"], spec, tuple(data["targets"]), to_torch(data["tensors"]))
        service.checkpoints.put_snapshot(path, tenant, base_model, snap)
        counts["snapshots"] += 1
    for sampler_id, tenant, base_model, model_path in journal.samplers():
        try:
            await service.samplers.restore(sampler_id, tenant, base_model, model_path)
            counts["samplers"] += 1
        except WorkerError as exc:
            logger.warning("sampler %s not restored: %s", sampler_id, exc.message)
            journal.sampler_dropped(sampler_id)
    for row in journal.runs():
        try:
            run = await service.runs.restore(row, journal.ops(row.run_id))
        except WorkerError as exc:  # its model is no longer served, or over a limit
            logger.error("run %s not restored: %s", row.run_id, exc.message)
            run = None
        counts["runs"] += run is not None
    for rid, tenant, sampler_id, body in journal.unfinished_samples():
        try:
            service.samplers.submit(sampler_id, SampleRequest.model_validate_json(body), tenant, request_id=rid,
                                    requeued=True)
            counts["samples_requeued"] += 1
        except WorkerError as exc:  # its sampler or weights are gone: the poll gets the reason
            service.requests.restore(rid, tenant, "sample", None, exc, 0.0)
            journal.request_finished(Job(rid, "sample", dict, owner=tenant), None, exc)
    for hook in service.recovery_hooks:  # each front end takes up its own records, on top of the service's
        counts.update(await hook())
    counts["seconds"] = round(time.perf_counter() - started, 3)
    if any(value for name, value in counts.items() if name not in ("seconds", "orphans_removed")):
        logger.warning("recovered from %s: %s", journal.dir, counts)
    return counts
