"""A checkpoint's download archive: one tar of its PEFT adapter folder, built once and kept beside it.

The tar holds ``adapter_config.json``, ``adapter_model.safetensors`` and an empty ``checkpoint_complete``
marker (last, as Tinker's archives end), at the top level, so ``tarfile.open(path).extractall(dir)`` gives a
folder that ``peft.PeftModel.from_pretrained(base, dir)`` and vLLM's ``--lora-modules name=dir`` load as is.
It never contains the optimizer state or the worker's metadata (which names the tenant).

The archive is written by streaming the files through ``tarfile`` into a temporary file in the checkpoint's
own folder, then renamed to ``.archive.tar`` there: a checkpoint folder is never changed once written (an
overwrite replaces the whole folder, a delete removes it), so the cached archive goes with its checkpoint
and can never describe another version of it. Every file is read through one open handle of the folder, so
an overwrite during a build cannot mix two versions; a build that loses such a race reports the checkpoint
as gone. The tar's bytes depend only on the checkpoint (fixed owner, mode and modification time), so two
builds of one checkpoint are identical, which lets a client resume a download across a rebuild.

At most ``max_builds`` archives are built at once over the whole worker; one more answers 429. Callers of
the same checkpoint wait for the build already running instead of starting their own. A cached archive counts in
its tenant's ``--max-storage-bytes-per-tenant`` (``cached_size``); one that would not fit is not built
(``expected_size``, checked by the service).
"""

from __future__ import annotations

import json
import os
import tarfile
import threading
from pathlib import Path

from server_mock.errors import WorkerError
from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore

ARCHIVE_NAME = ".archive.tar"
MEMBERS = ("adapter_config.json", "adapter_model.safetensors")
MARKER = "checkpoint_complete"
CHUNK = 1 << 20  # bytes copied at a time: a build never holds a file in memory


class Archives:
    def __init__(self, store: CheckpointStore, max_builds: int) -> None:
        self.store = store
        self.max_builds = max_builds
        self._slots = threading.BoundedSemaphore(max_builds)
        self._guard = threading.Lock()
        self._building: dict[str, threading.Lock] = {}

    def path(self, ref: CheckpointRef) -> Path:
        return self.store.folder(ref) / ARCHIVE_NAME

    def cached_size(self, ref: CheckpointRef) -> int:
        """The bytes of ``ref``'s cached archive (0 when none is built)."""
        try:
            return self.path(ref).stat().st_size
        except FileNotFoundError:
            return 0

    def expected_size(self, ref: CheckpointRef) -> int:
        """The bytes ``ref``'s archive will take, from its files' sizes (a ustar header and 512-byte padding per
        member, the end-of-archive blocks, the whole padded to tar's record size); 404 if a member is missing."""
        folder = self.store.folder(ref)
        blocks = 1  # the empty marker's header
        for name in MEMBERS:
            try:
                size = (folder / name).stat().st_size
            except FileNotFoundError:
                raise WorkerError(404, "checkpoint_incomplete", f"path: {ref.path} has no {name}", "path") from None
            blocks += 1 + -(-size // tarfile.BLOCKSIZE)
        body = (blocks + 2) * tarfile.BLOCKSIZE
        return -(-body // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def ensure(self, ref: CheckpointRef) -> Path:
        """The archive of ``ref``, built now if it is not cached yet (blocking: call from a worker thread)."""
        archive = self.path(ref)
        if archive.is_file():
            return archive
        with self._guard:
            lock = self._building.setdefault(ref.path, threading.Lock())
        with lock:  # one build per checkpoint; the others wait for it and then find the file
            if archive.is_file():
                return archive
            if not self._slots.acquire(blocking=False):
                raise WorkerError(429, "too_many_archive_builds",
                                  f"path: {self.max_builds} checkpoint archives are being built right now (limit "
                                  f"max_archive_builds={self.max_builds}); retry in a moment or raise "
                                  "--max-archive-builds")
            try:
                self._build(ref)
            finally:
                self._slots.release()
                with self._guard:
                    self._building.pop(ref.path, None)
        return archive

    def _build(self, ref: CheckpointRef) -> None:
        folder = self.store.folder(ref)
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise _gone(ref) from None
        tmp = f"{ARCHIVE_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            with os.fdopen(os.open("meta.json", os.O_RDONLY, dir_fd=dir_fd)) as meta:
                mtime = int(json.load(meta).get("created_at", 0))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as out:
                with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT, copybufsize=CHUNK) as tar:
                    for name in MEMBERS:
                        try:
                            member = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
                        except FileNotFoundError:
                            raise WorkerError(404, "checkpoint_incomplete",
                                              f"path: {ref.path} has no {name}", "path") from None
                        with os.fdopen(member, "rb") as source:
                            tar.addfile(_info(name, os.fstat(source.fileno()).st_size, mtime), source)
                    tar.addfile(_info(MARKER, 0, mtime))
                out.flush()
                os.fsync(out.fileno())
            os.rename(tmp, ARCHIVE_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            tmp = ""
            try:
                same = os.path.samestat(os.fstat(dir_fd), os.stat(folder))
            except FileNotFoundError:
                same = False
            if not same:  # overwritten or deleted while we read it: the archive went with the old folder
                raise _gone(ref)
        except FileNotFoundError:  # the folder was removed while we wrote into it
            raise _gone(ref) from None
        finally:
            if tmp:
                try:
                    os.unlink(tmp, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
            os.close(dir_fd)


def _info(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, mtime, 0o644, tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _gone(ref: CheckpointRef) -> WorkerError:
    return WorkerError(404, "checkpoint_not_found", f"path: {ref.path} was deleted or overwritten while its "
                                                    "archive was being built; ask for a new download URL", "path")
