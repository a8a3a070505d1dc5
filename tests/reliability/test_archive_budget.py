"""Cached download archives count in their tenant's --max-storage-bytes-per-tenant (service/checkpoints.py,
storage/archive.py): an archive that would take the tenant past it is not built (507 naming the flag), and a save
counts the archives already built. Before, five checkpoints within a 500000-byte budget plus their archives held
908430 bytes (1.82x). Checkpoints written straight to a store, no model."""

from __future__ import annotations

import json

import pytest
import torch

from server_mock.errors import WorkerError
from server_mock.service.checkpoints import Checkpoints
from server_mock.service.quotas import TenantLRU
from server_mock.storage.archive import Archives
from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore, folder_size

TENANT = "tenant-a"


def saved(store: CheckpointStore, name: str, values: int) -> CheckpointRef:
    ref = CheckpointRef("run-1", "sampler", name)
    store.write(ref, {"tenant": TENANT, "base_model": "tiny", "kind": "sampler"},
                {"adapter_model.safetensors": {"w": torch.arange(values, dtype=torch.float32)}},
                {"adapter_config.json": json.dumps({"r": 2})})
    return ref


def service(tmp_path, budget: int) -> tuple[CheckpointStore, Checkpoints]:
    store = CheckpointStore(tmp_path / "storage")
    return store, Checkpoints(store, TenantLRU(4), max_bytes_per_tenant=budget, archives=Archives(store, 2))


def test_the_expected_size_is_the_archives_size(tmp_path):
    store, checkpoints = service(tmp_path, 0)
    for values in (1, 127, 128, 5000):
        ref = saved(store, f"c{values}", values)
        expected = checkpoints.archives.expected_size(ref)
        _, archive, _ = checkpoints.archive(ref.path, TENANT)
        assert archive.stat().st_size == expected


@pytest.mark.parametrize("past", [0, 1])
def test_an_archive_at_the_budget_is_built_and_one_byte_past_is_not(tmp_path, past):
    store, checkpoints = service(tmp_path, 0)
    refs = [saved(store, name, 4000) for name in ("a", "b")]
    checkpoints.archive(refs[0].path, TENANT)
    held = sum(folder_size(store.folder(r)) for r in refs) + checkpoints.archives.cached_size(refs[0])
    need = checkpoints.archives.expected_size(refs[1])
    checkpoints.max_bytes_per_tenant = held + need - past
    if past:
        with pytest.raises(WorkerError) as err:
            checkpoints.archive(refs[1].path, TENANT)
        assert (err.value.status, err.value.code, err.value.field) == (507, "storage_budget_exceeded", "path")
        assert "--max-storage-bytes-per-tenant" in err.value.message and f"needs {need} bytes" in err.value.message
        assert checkpoints.archives.cached_size(refs[1]) == 0  # nothing was written
    else:
        checkpoints.archive(refs[1].path, TENANT)
        assert checkpoints._used(TENANT) == checkpoints.max_bytes_per_tenant  # exactly the budget
    checkpoints.archive(refs[0].path, TENANT)  # a cached archive is served whatever the budget


@pytest.mark.parametrize("past", [0, 1])
def test_saves_count_the_archives_already_built(tmp_path, past):
    store, checkpoints = service(tmp_path, 0)
    first = saved(store, "a", 4000)
    checkpoints.archive(first.path, TENANT)
    tensors = {"adapter_model.safetensors": {"w": torch.zeros(1000)}}
    held = folder_size(store.folder(first)) + checkpoints.archives.cached_size(first)
    checkpoints.max_bytes_per_tenant = held + 4000 - past  # 1000 float32 values: 4000 bytes
    new = CheckpointRef("run-1", "sampler", "b")
    if past:
        with pytest.raises(WorkerError) as err:
            checkpoints._check_budget(TENANT, new, tensors)
        assert err.value.code == "storage_budget_exceeded" and "with their archives" in err.value.message
    else:
        checkpoints._check_budget(TENANT, new, tensors)
    checkpoints._check_budget(TENANT, first, tensors)  # an overwrite does not count what it replaces
