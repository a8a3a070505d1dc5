"""Taking a SmolLM2-135M adapter home: the size of its download archive, the time to build it, and the time to
merge it into a full model folder, each against a plain copy of the same files in the same process.

The adapter is the worker's own (``LocalModelHost``, rank 16, attention + MLP + head, moved off its initial
weights), saved the way a checkpoint is saved (``Checkpoints.save`` writes the PEFT folder); the archive is
built by ``storage.archive.Archives`` and the merge is ``pytrio_compat.export.merge``.

    python benchmarks/export_archive.py [--rank 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import SMOLLM2, median, save, timer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from pytrio_compat.export import merge
    from pytrio_compat.wire import LoraSpec, SaveOp
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.engine.loading import resolve_source
    from server_mock.service.checkpoints import Checkpoints
    from server_mock.service.quotas import TenantLRU
    from server_mock.storage.archive import Archives
    from server_mock.storage.checkpoints import CheckpointStore

    source = resolve_source(SMOLLM2)
    host = LocalModelHost("smol", source, "cpu", torch.float32)
    adapter = host.create_adapter("bench", LoraSpec(rank=args.rank, seed=0))
    with torch.no_grad():
        for param in adapter.params.values():
            param.add_(torch.randn_like(param) * 1e-3)  # as after training: lora_B is no longer zero

    class Run:  # what Checkpoints.save reads of a training run
        run_id, tenant, base_model, spec = "run-bench", "bench", "smol", adapter.spec

    Run.adapter = adapter
    root = Path(tempfile.mkdtemp(prefix="export-bench-"))
    try:
        store = CheckpointStore(root / "storage")
        checkpoints = Checkpoints(store, TenantLRU(1), Archives(store, max_builds=1))
        checkpoints.save(Run, host, SaveOp(op="save_weights_for_sampler", name="bench"))
        ref = store.list()[0][0]
        folder = store.folder(ref)
        archives = checkpoints.archives
        copy_s, build_s, merge_s, merge_copy_s = [], [], [], []
        for i in range(args.repeats):
            with timer(copy_s):  # baseline: copy the two adapter files
                for name in ("adapter_config.json", "adapter_model.safetensors"):
                    shutil.copyfile(folder / name, root / f"copy-{i}-{name}")
            archives.path(ref).unlink(missing_ok=True)
            with timer(build_s):
                archive = archives.ensure(ref)
            with timer(merge_copy_s):  # baseline: copy the base model folder
                shutil.copytree(source, root / f"base-copy-{i}")
            with timer(merge_s):
                report = merge(Path(source), folder, root / f"merged-{i}")
        payload = {
            "model": SMOLLM2, "rank": args.rank, "targets": len(host.lora_targets(adapter.spec)),
            "adapter_bytes": (folder / "adapter_model.safetensors").stat().st_size,
            "archive_bytes": archive.stat().st_size,
            "archive_build_s": round(median(build_s), 4), "copy_adapter_files_s": round(median(copy_s), 4),
            "archive_build_vs_copy": round(median(build_s) / median(copy_s), 2),
            "merge_s": round(median(merge_s), 3), "copy_base_model_s": round(median(merge_copy_s), 3),
            "merge_vs_copy_base": round(median(merge_s) / median(merge_copy_s), 2),
            "merged_untied_head": report["untied_head"], "repeats": args.repeats,
        }
        save("export_archive", payload)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
