"""What the console shows, as one JSON object (``GET /operator/state``): per tenant its runs (id, base model, step,
last op and when), its queued jobs, its fair-share books per model queue (``fair_share``: counter, served cost and
weight; engine/fairness.py), token totals (the page turns two of them into tokens per second) and recent
errors; each model thread's running batch; the worker's memory. Tenants are the ids of their keys, never keys."""

from __future__ import annotations

import time

from server_mock.service.metrics import device_memory, resident_bytes, tenant_label

MAX_RUNS_SHOWN = 256  # per tenant: a tenant at --max-training-runs shows its most recently active ones


def console_state(service) -> dict:
    usage = service.usage
    activity = usage.activity.snapshot()
    tenants: dict[str, dict] = {}

    def tenant(name: str) -> dict:
        if name not in tenants:
            tenants[name] = {"tenant": name, "queued": {}, "runs": [], "errors": [], "fair_share": {},
                             "tokens": {"train": 0, "prefill": 0, "generation": 0}}
        return tenants[name]

    for queue in list(service.models.queues.values()):
        for (owner, kind), count in queue.waiting().items():
            queued = tenant(tenant_label(owner))["queued"]
            queued[kind] = queued.get(kind, 0) + count
    for name, queue in sorted(service.models.queues.items()):
        for owner, books in queue.fairness().items():
            tenant(tenant_label(owner))["fair_share"][name] = books
    for run in service.runs.live():
        last = usage.activity.last_op(run.run_id)
        tenant(run.tenant)["runs"].append({
            "run_id": run.run_id, "base_model": run.base_model, "step": int(getattr(run.adapter, "optim_steps", 0)),
            "rank": run.spec.rank, "last_op": last[0] if last else None, "last_op_at": last[1] if last else None,
            "last_status": last[2] if last else None})
    for name, totals in activity["tokens"].items():
        tenant(name)["tokens"] = totals
    for name, errors in activity["errors"].items():
        tenant(name)["errors"] = list(reversed(errors))  # newest first
    for entry in tenants.values():
        entry["runs"].sort(key=lambda r: -(r["last_op_at"] or 0))
        del entry["runs"][MAX_RUNS_SHOWN:]
    total = service.adapter_memory.total
    device = [{"device": d, "kind": k, "bytes": b} for d, k, b in device_memory(service.models.device)]
    return {
        "now": time.time(),
        "started": service.started,
        "models": sorted(service.models.hosts),
        "tenants": sorted(tenants.values(), key=lambda t: t["tenant"]),
        "running": activity["running"],
        "memory": {"process_resident_bytes": resident_bytes(), "adapter_bytes": service.adapter_memory.held,
                   "adapter_budget_bytes": total,
                   "device": device},
    }
