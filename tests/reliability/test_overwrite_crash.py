"""An overwrite moves the old checkpoint aside before moving the new one in; a crash between the two renames left
no checkpoint under its name. The leftovers pass at start moves the old one back, and deletes what no name needs."""

from __future__ import annotations

import os

import torch

from server_mock.storage.checkpoints import CheckpointRef, CheckpointStore


def write(store: CheckpointStore, ref: CheckpointRef, value: float, overwrite: bool = False) -> None:
    store.write(ref, {"kind": "state", "tenant": "t"}, {"adapter_model.safetensors": {"w": torch.full((2,), value)}},
                {}, overwrite=overwrite)


def test_a_crash_between_the_overwrite_renames_keeps_the_old_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    ref = CheckpointRef("run-0123456789abcdef", "state", "ck")
    write(store, ref, 1.0)
    before = (store.folder(ref) / "adapter_model.safetensors").read_bytes()
    # the state a SIGKILL between os.rename(final, trash) and os.rename(tmp, final) leaves
    final = store.folder(ref)
    os.rename(final, final.with_name(".ck.old-123-456"))
    (final.with_name(".ck.tmp-abc")).mkdir()
    assert not store.exists(ref)

    assert store.remove_leftovers() == 2
    assert store.exists(ref) and (final / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in final.parent.iterdir()) == ["ck"]


def test_a_replaced_folder_whose_name_holds_a_checkpoint_is_deleted(tmp_path):
    store = CheckpointStore(tmp_path)
    ref = CheckpointRef("run-0123456789abcdef", "state", "ck")
    write(store, ref, 1.0)
    write(store, ref, 2.0, overwrite=True)
    after = (store.folder(ref) / "adapter_model.safetensors").read_bytes()
    stale = store.folder(ref).with_name(".ck.old-1-2")
    stale.mkdir()
    (stale / "meta.json").write_text("{}")
    assert store.remove_leftovers() == 1
    assert not stale.exists() and (store.folder(ref) / "adapter_model.safetensors").read_bytes() == after
