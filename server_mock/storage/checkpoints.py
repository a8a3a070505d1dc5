"""Checkpoints on disk: safetensors + JSON only (never pickle), addressed by opaque trio:// paths.

Layout: ``<storage>/checkpoints/<run_id>/<kind>/<name>/`` with kind ``state`` (weights + Adam state) or
``sampler`` (weights only). The weights are a standard PEFT adapter folder (``adapter_model.safetensors``
+ ``adapter_config.json``), so a saved adapter loads in plain PEFT or vLLM as-is. Writes go to a
temporary folder that is fsynced and renamed into place: a checkpoint is whole or absent. A third kind,
``external``, holds weights exported for download in another service's layout (Tinker's
``save_weights_external``, possibly encrypted); it has no ``trio://`` path, only its ``CheckpointRef``.
Files whose names start with a dot (a cached download archive) are derived data: they are not counted
in a checkpoint's size (the service counts the archive in its tenant's storage budget) and go with the folder
when it is overwritten or deleted.

Expiry: a checkpoint saved with ``ttl_seconds`` (or given one later, ``set_expiry``) carries ``expires_at`` in its
``meta.json``. From that moment it is absent to every reader (``exists``, ``read_meta``, ``list``), and the
worker's sweeper deletes its folder (``sweep_expired``, every ``--checkpoint-sweep-seconds``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from server_mock.errors import WorkerError, bad_request
from server_mock.storage import crash_points
from server_mock.storage.files import fsync_path

# anchored with \Z, not $ (which also matches before a trailing newline), so .match and .fullmatch both hold
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?\Z")
RUN_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}\Z")
PATH_RE = re.compile(r"^trio://(?P<run>[^/]+)/(?P<kind>state|sampler)/(?P<name>[^/]+)\Z")
KINDS = ("state", "sampler")
ALL_KINDS = (*KINDS, "external")


@dataclass(frozen=True)
class CheckpointRef:
    run_id: str
    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"trio://{self.run_id}/{self.kind}/{self.name}"


def parse_path(path: str, field: str = "path") -> CheckpointRef:
    match = PATH_RE.fullmatch(path) if isinstance(path, str) else None
    if not match or not RUN_RE.fullmatch(match["run"]) or not NAME_RE.fullmatch(match["name"]) \
            or len(match["name"]) > 200:
        raise bad_request(field, f"{_clip(path)} is not a checkpoint path of this worker; expected trio://<run>/"
                                 "<state|sampler>/<name> as returned by save_state/save_weights_for_sampler",
                          code="invalid_checkpoint_path")
    return CheckpointRef(match["run"], match["kind"], match["name"])


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or len(name) > 200:
        raise bad_request(field, f"invalid checkpoint name {_clip(name)}: use letters, digits, '.', '_', '-', "
                                 "starting with a letter or digit", code="invalid_checkpoint_name")
    return name


def expires_at(meta: dict) -> float | None:
    """When a checkpoint expires (seconds since the epoch), or None: ``expires_at``, else (checkpoints written
    before it was stored) ``created_at + ttl_seconds``."""
    if "expires_at" in meta:
        return meta["expires_at"]
    ttl = meta.get("ttl_seconds")
    return meta.get("created_at", 0.0) + ttl if ttl else None


def is_expired(meta: dict, now: float | None = None) -> bool:
    when = expires_at(meta)
    return when is not None and when <= (time.time() if now is None else now)


class CheckpointStore:
    """Checkpoints under ``root``. Which runs hold a tenant's checkpoints is kept in memory (read from the
    runs' metadata once, on the first listing, then kept up to date by every write), so listing one tenant's
    checkpoints reads only that tenant's folders."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)
        self._runs_of: dict[str, set[str]] | None = None  # tenant -> run ids with checkpoints
        self._index_lock = threading.Lock()

    def build_index(self) -> None:
        """Read which tenant each run with checkpoints belongs to (one metadata file per run)."""
        runs_of: dict[str, set[str]] = {}
        base = self.root / "checkpoints"
        for run in base.iterdir():
            if not run.is_dir() or not RUN_RE.fullmatch(run.name):
                continue
            owner = self._run_owner(run)
            if owner is not None:
                runs_of.setdefault(owner, set()).add(run.name)
        with self._index_lock:
            self._runs_of = runs_of

    @staticmethod
    def _run_owner(run: Path) -> str | None:
        for kind in KINDS:
            folder = run / kind
            if not folder.is_dir():
                continue
            for ckpt in folder.iterdir():
                meta = ckpt / "meta.json"
                if not ckpt.name.startswith(".") and meta.exists():
                    try:
                        return json.loads(meta.read_text()).get("tenant", "")
                    except (OSError, ValueError):
                        continue
        return None

    def runs_of(self, tenant: str) -> list[str]:
        """The runs that hold (or held) checkpoints of ``tenant``."""
        if self._runs_of is None:
            self.build_index()
        with self._index_lock:
            return sorted(self._runs_of.get(tenant, ()))

    def _index(self, run_id: str, tenant: str) -> None:
        with self._index_lock:
            if self._runs_of is not None:
                self._runs_of.setdefault(tenant, set()).add(run_id)

    def folder(self, ref: CheckpointRef) -> Path:
        return self.root / "checkpoints" / ref.run_id / ref.kind / ref.name

    def _meta_or_none(self, ref: CheckpointRef) -> dict | None:
        """Its metadata, or None when it is absent or expired."""
        path = self.folder(ref) / "meta.json"
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return None if is_expired(meta) else meta

    def exists(self, ref: CheckpointRef) -> bool:
        return self._meta_or_none(ref) is not None

    def write(self, ref: CheckpointRef, meta: dict, tensors: dict[str, dict[str, torch.Tensor]],
              files: dict[str, str], overwrite: bool = False, seal: Callable[[Path], None] | None = None) -> int:
        """Write tensor files (name -> state dict) and text files atomically; return the size in bytes.
        ``seal(folder)`` may transform the written files (encrypt them) before they are put in place."""
        final = self.folder(ref)
        if final.exists() and not overwrite and self.exists(ref):  # an expired one is gone: its name is free
            raise WorkerError(409, "checkpoint_exists", f"name: checkpoint {ref.path} already exists; "
                                                        "pass overwrite=True or choose another name", "name")
        final.parent.mkdir(parents=True, exist_ok=True)
        self._index(ref.run_id, meta.get("tenant", ""))
        tmp = Path(tempfile.mkdtemp(prefix=f".{ref.name}.tmp-", dir=final.parent))
        try:
            for filename, state in tensors.items():
                save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / filename))
            crash_points.reached("save_state" if meta.get("kind") == "state" else "save_weights")
            for filename, text in files.items():
                (tmp / filename).write_text(text)
            created = time.time()
            ttl = meta.get("ttl_seconds")
            stamped = {**meta, "created_at": created, "expires_at": created + ttl if ttl else None}
            (tmp / "meta.json").write_text(json.dumps(stamped, indent=1))
            if seal is not None:
                seal(tmp)
            for item in tmp.iterdir():
                fsync_path(item)
            fsync_path(tmp)
            if final.exists():
                trash = final.with_name(f".{ref.name}.old-{os.getpid()}-{time.monotonic_ns()}")
                os.rename(final, trash)
                os.rename(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_path(final.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder_size(final)

    def remove_leftovers(self) -> int:
        """Tidy what a crash left in the middle of a write; how many folders. An overwrite moves the old checkpoint
        aside (``.name.old-*``) before it moves the new one in: a crash between the two leaves no folder under the
        name, so the old one (acknowledged before) is moved back. Temporary folders and replaced ones whose name
        holds a checkpoint again are deleted (a write that did not finish was never acknowledged)."""
        handled = 0
        replaced = [f for f in self.root.glob("checkpoints/*/*/.*") if f.is_dir() and ".old-" in f.name]
        for folder in sorted(replaced, key=lambda f: f.stat().st_mtime, reverse=True):  # the newest first
            final = folder.with_name(folder.name[1:].split(".old-", 1)[0])
            if not final.exists() and (folder / "meta.json").exists():
                os.rename(folder, final)
            else:
                shutil.rmtree(folder, ignore_errors=True)
            handled += 1
        for folder in self.root.glob("checkpoints/*/*/.*"):
            if folder.is_dir() and ".tmp-" in folder.name:
                shutil.rmtree(folder, ignore_errors=True)
                handled += 1
        return handled

    def read_meta(self, ref: CheckpointRef) -> dict:
        meta = self._meta_or_none(ref)
        if meta is None:
            raise WorkerError(404, "checkpoint_not_found", f"path: no checkpoint at {ref.path}", "path")
        return meta

    def set_expiry(self, ref: CheckpointRef, when: float | None) -> dict:
        """Give a checkpoint a new expiry time (None: it never expires); its metadata is replaced atomically.
        Returns the new metadata."""
        meta = {**self.read_meta(ref), "expires_at": when}
        folder = self.folder(ref)
        fd, tmp = tempfile.mkstemp(prefix=".meta-", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(meta, indent=1))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder / "meta.json")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_path(folder)
        return meta

    def read_tensors(self, ref: CheckpointRef, filename: str) -> dict[str, torch.Tensor]:
        path = self.folder(ref) / filename
        if not path.exists():
            raise WorkerError(404, "checkpoint_incomplete", f"path: {ref.path} has no {filename}", "path")
        return load_file(str(path))

    def fingerprint(self, ref: CheckpointRef) -> dict[str, bytes]:
        """Every tensor of a save_state checkpoint (weights and Adam state) as raw bytes, keyed by file and
        name: two checkpoints are bit-identical exactly when their fingerprints are equal."""
        out = {}
        for filename in ("adapter_model.safetensors", "optimizer.safetensors"):
            for name, tensor in self.read_tensors(ref, filename).items():
                out[f"{filename}:{name}"] = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return out

    def delete(self, ref: CheckpointRef) -> None:
        if not self.exists(ref):
            raise WorkerError(404, "checkpoint_not_found", f"path: no checkpoint at {ref.path}", "path")
        shutil.rmtree(self.folder(ref))

    def list(self, run_id: str | None = None, tenant: str | None = None, include_expired: bool = False,
             kinds: tuple[str, ...] = KINDS) -> list[tuple[CheckpointRef, dict, int]]:
        """(ref, metadata, size in bytes) of the checkpoints of ``kinds`` of one run, of the runs of one tenant, or
        all; expired ones left out unless asked."""
        base = self.root / "checkpoints"
        if run_id and not RUN_RE.fullmatch(run_id):
            raise bad_request("training_run_id", f"invalid run id {run_id[:80]!r}")
        if run_id:
            runs = [base / run_id]
        elif tenant is not None:
            runs = [base / run for run in self.runs_of(tenant)]
        else:
            runs = sorted(p for p in base.iterdir() if p.is_dir())
        runs = [r for r in runs if r.is_dir()]
        out = []
        for run in runs:
            for kind in kinds:
                folder = run / kind
                if not folder.is_dir():
                    continue
                for ckpt in sorted(folder.iterdir()):
                    if ckpt.name.startswith(".") or not (ckpt / "meta.json").exists():
                        continue
                    try:
                        meta = json.loads((ckpt / "meta.json").read_text())
                        size = folder_size(ckpt)
                    except FileNotFoundError:  # deleted while listed
                        continue
                    if include_expired or not is_expired(meta):
                        out.append((CheckpointRef(run.name, kind, ckpt.name), meta, size))
        return out

    def sweep_expired(self) -> list[CheckpointRef]:
        """Delete the checkpoints (of every kind) whose expiry time has passed; returns them."""
        removed = []
        now = time.time()
        for ref, meta, _ in self.list(include_expired=True, kinds=ALL_KINDS):
            if is_expired(meta, now):
                shutil.rmtree(self.folder(ref), ignore_errors=True)
                removed.append(ref)
        return removed


def folder_size(folder: Path) -> int:
    """The bytes of a checkpoint's files, not counting derived (dot) files."""
    return sum(f.stat().st_size for f in folder.iterdir() if not f.name.startswith(".") and f.is_file())




def _clip(value: object) -> str:
    """A sent value for a message: its repr, cut to 100 characters."""
    text = repr(value[:100] if isinstance(value, str) else value)
    return text if len(text) <= 103 else text[:100] + "..."
