"""Checkpoints as a tenant sees them: owned paths (on disk or in-memory snapshots), their config, listing and
deletion, and the saving and loading of a run's weights (on the model's thread).

Every method here reads or writes the disk: route handlers call them through ``asyncio.to_thread``, and the
save/load work runs on the model's queue thread.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path

from pytrio_compat.wire import CheckpointConfig, CheckpointEntry, CheckpointList, LoraSpec, SaveOp
from server_mock.engine.host import ModelHost
from server_mock.errors import WorkerError, bad_request, not_found, storage_error
from server_mock.lora import Snapshot
from server_mock.service.journal import Journal
from server_mock.service.quotas import TenantLRU
from server_mock.storage.archive import MARKER, Archives
from server_mock.storage.checkpoints import NAME_RE, RUN_RE, CheckpointRef, CheckpointStore, expires_at, parse_path
from server_mock.storage.encryption import encrypt_folder

# (PEFT tensors, adapter_config dict, whether the model ties its head) -> the same in another service's layout
ExportLayout = Callable[[dict, dict, bool], tuple[dict, dict]]


def checkpoint_id(path: str) -> str:
    """The short id a checkpoint is listed (and may be deleted) by, in every protocol."""
    return hashlib.sha256(path.encode()).hexdigest()[:16]


class Checkpoints:
    def __init__(self, store: CheckpointStore, snapshots: TenantLRU[tuple[str, Snapshot]],
                 journal: Journal | None = None, max_bytes_per_tenant: int = 0,
                 archives: Archives | None = None) -> None:
        self.store = store
        self.max_bytes_per_tenant = max_bytes_per_tenant  # --max-storage-bytes-per-tenant (0: no limit)
        self.journal = journal  # --durability full: in-memory snapshots written there too (service/journal.py)
        self.snapshots = snapshots  # sampler path -> (base model, weights) kept in memory, per tenant
        self.archives = archives or Archives(store, max_builds=2)
        # expiry time of the saved checkpoints held in ``snapshots``: a sampler reading one stops at its expiry
        # without a disk read
        self.snapshot_expiry: dict[str, float] = {}

    def remember_expiry(self, path: str, meta: dict) -> None:
        when = expires_at(meta)
        if when is None:
            self.snapshot_expiry.pop(path, None)
        else:
            self.snapshot_expiry[path] = when

    def drop_if_expired(self, path: str) -> None:
        """Forget the in-memory copy of a saved checkpoint whose expiry time has passed (no disk read)."""
        when = self.snapshot_expiry.get(path)
        if when is not None and when <= time.time():
            self.snapshots.pop(path)
            self.snapshot_expiry.pop(path, None)

    def put_snapshot(self, path: str, tenant: str, base_model: str, snap: Snapshot) -> None:
        """Keep an in-memory snapshot (the tenant's least recently used one goes when over its quota)."""
        for evicted in self.snapshots.put(path, tenant, (base_model, snap)):
            if self.journal is not None:
                self.journal.snapshot_dropped(evicted)

    def owned_ref(self, path: str, tenant: str, field_name: str) -> CheckpointRef:
        """The checkpoint (on disk or an in-memory snapshot) at ``path`` if it is this tenant's; else 404.
        An expired one is absent."""
        ref = parse_path(path, field_name)
        self.drop_if_expired(path)
        owner = self.snapshots.owner(path)
        if owner is not None:
            if owner != tenant:
                raise WorkerError(404, "checkpoint_not_found", f"{field_name}: no checkpoint at {path}", field_name)
            return ref
        meta_tenant = None
        if self.store.exists(ref):
            meta_tenant = self.store.read_meta(ref).get("tenant", "")
        if meta_tenant is None or meta_tenant != tenant:
            # 404, not 403: another tenant's checkpoints must not even be seen to exist
            raise WorkerError(404, "checkpoint_not_found", f"{field_name}: no checkpoint at {path}", field_name)
        return ref

    def config(self, path: str, tenant: str) -> CheckpointConfig:
        ref = self.owned_ref(path, tenant, "path")
        meta = self.store.read_meta(ref)
        return CheckpointConfig(path=path, kind=ref.kind, base_model=meta["base_model"],
                                lora=LoraSpec.model_validate(meta["lora"]),
                                has_optimizer=meta.get("has_optimizer", False))

    def resolve(self, path_or_id: str, tenant: str) -> str:
        """The trio:// path of one of this tenant's checkpoints, given the path or its id from ``list``."""
        if path_or_id.startswith("trio://"):
            return path_or_id
        matches = [c.path for c in self.list(tenant, None).checkpoints if c.checkpoint_id == path_or_id]
        if not matches:
            raise not_found("checkpoint", path_or_id)
        return matches[0]

    def archive(self, path_or_id: str, tenant: str) -> tuple[CheckpointRef, Path, str]:
        """The download archive of one of this tenant's saved checkpoints (built now if need be), and its
        version: a string that changes whenever the checkpoint is overwritten."""
        path = self.resolve(path_or_id, tenant)
        ref = self.owned_ref(path, tenant, "path")
        if not self.store.exists(ref):
            raise bad_request("path", f"{path} is an in-memory sampler snapshot (save_weights_and_get_sampling_client)"
                                      " and has no files to download; save the weights with "
                                      "save_weights_for_sampler(name) or save_state(name) instead",
                              code="not_downloadable")
        version = f"{self.store.read_meta(ref).get('created_at', 0):.6f}"
        if self.max_bytes_per_tenant and not self.archives.cached_size(ref):
            need, used = self.archives.expected_size(ref), self._used(tenant)
            if used + need > self.max_bytes_per_tenant:
                raise WorkerError(507, "storage_budget_exceeded",
                                  f"path: the download archive of {path} needs {need} bytes and this API key's "
                                  f"checkpoints (with their archives) hold {used}, past max_storage_bytes_per_tenant="
                                  f"{self.max_bytes_per_tenant}: delete checkpoints (or give them a ttl_seconds) or "
                                  "raise --max-storage-bytes-per-tenant", "path")
        return ref, self.archives.ensure(ref), version

    def _used(self, tenant: str, skip: str | None = None) -> int:
        """What this tenant's checkpoints hold on disk, their cached download archives included (``skip``: one
        about to be overwritten, whose archive goes with it)."""
        return sum(size + self.archives.cached_size(ref) for ref, _, size in self.records(tenant)
                   if ref.path != skip)

    def records(self, tenant: str, training_run_id: str | None = None) -> list[tuple[CheckpointRef, dict, int]]:
        """This tenant's checkpoints on disk (of one run), unexpired: (ref, metadata, size in bytes) each."""
        return [(ref, meta, size) for ref, meta, size in self.store.list(training_run_id, tenant=tenant)
                if meta.get("tenant", "") == tenant]  # the store reads only the folders of this tenant's runs

    def set_expiry(self, path: str, tenant: str, when: float | None) -> dict:
        """A new expiry time for one of this tenant's checkpoints on disk (None: never); its new metadata."""
        ref = self.owned_ref(path, tenant, "path")
        if not self.store.exists(ref):
            raise WorkerError(404, "checkpoint_not_found", f"path: {path} is held in memory only (it has no "
                                                           "expiry time)", "path")
        meta = self.store.set_expiry(ref, when)
        if path in self.snapshot_expiry or self.snapshots.owner(path) is not None:
            self.remember_expiry(path, meta)
        return meta

    def sweep(self) -> int:
        """Delete expired checkpoints from disk, with their in-memory copies; returns how many."""
        removed = self.store.sweep_expired()
        for ref in removed:
            self.snapshots.pop(ref.path)
            self.snapshot_expiry.pop(ref.path, None)
        return len(removed)

    def list(self, tenant: str, training_run_id: str | None) -> CheckpointList:
        return CheckpointList(checkpoints=[entry for entry, _ in self.entries(tenant, training_run_id)])

    def entries(self, tenant: str, training_run_id: str | None) -> list[tuple[CheckpointEntry, dict]]:
        """This tenant's unexpired checkpoints on disk (of one run, or of all its runs), each with its metadata."""
        return [(CheckpointEntry(checkpoint_id=checkpoint_id(ref.path), kind=ref.kind, path=ref.path,
                                 created_at=meta.get("created_at", 0.0), size_bytes=size), meta)
                for ref, meta, size in self.records(tenant, training_run_id)]

    def delete(self, path_or_id: str, tenant: str) -> None:
        ref = self.owned_ref(self.resolve(path_or_id, tenant), tenant, "path")
        self.store.delete(ref)
        self.snapshots.pop(ref.path)
        self.snapshot_expiry.pop(ref.path, None)

    def state_meta(self, uri: str, tenant: str, field: str) -> dict:
        """The metadata of ``uri``, a ``save_state`` checkpoint of this tenant (400 naming ``field`` for sampler
        weights; 404 for another tenant's or a missing one). Reads one small file: call it off the event loop."""
        ref = self.owned_ref(uri, tenant, field)
        if ref.kind != "state":
            raise bad_request(field, f"{uri} holds sampler weights (save_weights_for_sampler); training starts from "
                                     "or loads a save_state checkpoint", code="invalid_checkpoint")
        return self.store.read_meta(ref)

    @staticmethod
    def check_layout(meta: dict, spec, base_model: str | None, field: str) -> None:
        """A checkpoint (its ``meta``) loaded into a run of ``spec`` on ``base_model`` (None: not compared) must
        have that LoRA layout; 400 ``checkpoint_config_mismatch`` naming ``field`` and what differs."""
        saved = LoraSpec.model_validate(meta["lora"])
        mismatches = [f for f in ("rank", "train_mlp", "train_attn", "train_unembed")
                      if getattr(saved, f) != getattr(spec, f)]
        if base_model is not None and meta["base_model"] != base_model:
            mismatches.insert(0, "base_model")
        if mismatches:
            raise WorkerError(400, "checkpoint_config_mismatch", f"{field}: the checkpoint does not match this "
                                                                  f"training run in: {', '.join(mismatches)}", field)

    # --- on the model's thread: save and load a run's weights (and Adam state) ---

    def save(self, run, host: ModelHost, op: SaveOp) -> dict:
        adapter = run.adapter
        kind = "state" if op.op == "save_state" else "sampler"
        ref = CheckpointRef(run.run_id, kind, op.name)
        if kind == "sampler" and op.ephemeral:
            snap = host.snapshot(adapter)
            if self.journal is not None:
                try:
                    self.journal.snapshot_saved(ref.path, run.tenant, run.base_model, snap)
                except Exception as exc:  # noqa: BLE001 - a full disk: no snapshot
                    raise storage_error(op.op, exc) from exc
            self.put_snapshot(ref.path, run.tenant, run.base_model, snap)
            size = sum(t.numel() * t.element_size() for t in snap.tensors.values())
            return {"path": ref.path, "size": size, "model": run.base_model}
        meta = {"base_model": run.base_model, "lora": run.spec.model_dump(), "tenant": run.tenant,
                "optim_steps": adapter.optim_steps, "ttl_seconds": op.ttl_seconds, "kind": kind,
                "has_optimizer": kind == "state",
                # the front end's labels: of this checkpoint, and of its run (kept so the run is known later)
                "user_metadata": op.user_metadata, "run_user_metadata": run.user_metadata}
        tensors = {"adapter_model.safetensors": host.adapter_weights(adapter)}
        if kind == "state":
            tensors["optimizer.safetensors"] = host.optimizer_state(adapter)
        files = {"adapter_config.json": host.peft_adapter_config(run.spec)}
        self._check_budget(run.tenant, ref, tensors)
        try:
            size = self.store.write(ref, meta, tensors, files, overwrite=op.overwrite)
        except OSError as exc:  # a full disk: the temporary folder is gone, no checkpoint half written
            raise storage_error(op.op, exc) from exc
        if kind == "sampler":
            self.snapshots.pop(ref.path)  # a re-save must not serve the old weights
        return {"path": ref.path, "size": size, "model": run.base_model}

    def room(self, tenant: str) -> int | None:
        """Bytes left in the tenant's --max-storage-bytes-per-tenant (checkpoints and journal counted); None: no
        limit."""
        if not self.max_bytes_per_tenant:
            return None
        used = self._used(tenant)
        used += self.journal.tenant_bytes(tenant) if self.journal is not None else 0
        return self.max_bytes_per_tenant - used

    def _check_budget(self, tenant: str, ref: CheckpointRef, tensors: dict) -> None:
        """Refuse a save that would take the tenant's checkpoints (and their cached download archives) past
        --max-storage-bytes-per-tenant, before any byte is written (a checkpoint it overwrites is not counted)."""
        if not self.max_bytes_per_tenant:
            return
        new = sum(t.numel() * t.element_size() for state in tensors.values() for t in state.values())
        used = self._used(tenant, skip=ref.path)
        used += self.journal.tenant_bytes(tenant) if self.journal is not None else 0
        if used + new > self.max_bytes_per_tenant:
            raise WorkerError(507, "storage_budget_exceeded",
                              f"this API key's checkpoints (with their archives) and journal hold {used} bytes and "
                              f"this one needs about {new} more, past "
                              f"max_storage_bytes_per_tenant={self.max_bytes_per_tenant}: delete checkpoints (or "
                              "give them a ttl_seconds) or raise --max-storage-bytes-per-tenant")

    def save_export(self, run, host: ModelHost, name: str, ttl_seconds: int | None, layout: ExportLayout,
                    recipients: list) -> dict:
        """Write the run's current weights as an ``external`` checkpoint for download (on the model's thread):
        the PEFT adapter converted by ``layout(tensors, adapter_config, tied_head)`` (another service's naming),
        an empty ``checkpoint_complete`` marker, and with ``recipients`` every file age-encrypted (``.age``)."""
        ref = CheckpointRef(run.run_id, "external", name)
        if self.store.exists(ref):
            raise WorkerError(409, "checkpoint_exists", f"path: external weights {name!r} of this run already exist; "
                                                        "choose another name or delete them first", "path")
        tensors, config = layout(host.adapter_weights(run.adapter), json.loads(host.peft_adapter_config(run.spec)),
                                 host.tied_head)
        meta = {"base_model": run.base_model, "lora": run.spec.model_dump(), "tenant": run.tenant, "kind": "external",
                "optim_steps": run.adapter.optim_steps, "ttl_seconds": ttl_seconds, "encrypted": bool(recipients),
                "run_user_metadata": getattr(run, "user_metadata", None)}
        seal = (lambda folder: encrypt_folder(folder, recipients)) if recipients else None
        self._check_budget(run.tenant, ref, {"adapter_model.safetensors": tensors})
        size = self.store.write(ref, meta, {"adapter_model.safetensors": tensors},
                                {"adapter_config.json": json.dumps(config, indent=1), MARKER: ""}, seal=seal)
        return {"run_id": run.run_id, "name": name, "size": size}

    def owned_export(self, run_id: str, name: str, tenant: str) -> CheckpointRef:
        """This tenant's (unexpired) external checkpoint ``name`` of run ``run_id``; else 404."""
        ref = CheckpointRef(run_id, "external", name)
        if not (RUN_RE.match(run_id) and NAME_RE.match(name) and self.store.exists(ref)
                and self.store.read_meta(ref).get("tenant", "") == tenant):
            raise WorkerError(404, "checkpoint_not_found", f"path: no external weights {name!r} in run {run_id!r}",
                              "path")
        return ref

    def load(self, run, host: ModelHost, ref: CheckpointRef, with_optimizer: bool) -> dict:
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
