"""Exactness: one fixed, seeded workload through the native, Tinker and PyTRIO front ends, every number kept.

A tiny random model is written here (``make_tiny_model``, seed 0) and served by a worker in this process (uvicorn
on a loopback port). Each front end, through its own client (``pytrio_compat``, the official ``tinker`` SDK, the
official ``pytrio`` SDK in a child process as its users run it), makes a LoRA run with the same seed and data and
records: the loss of each forward_backward, the grad norm of each optim_step, the logprobs of a probe forward, the
tokens and logprobs of seeded samples, and a hash of the saved state (weights and optimizer moments).

    python benchmarks/exactness.py                      # print, save results/exactness.json
    python benchmarks/exactness.py --out before.json    # save elsewhere
    python benchmarks/exactness.py --compare results/exactness_before.json   # exit 1 unless identical

A refactor that changes none of the maths must leave every number bit-identical (floats are kept exactly: JSON
round-trips a Python float).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KEY = "exactness-key"
MODEL = "tiny"
STEPS = 3
LORA = {"rank": 8, "seed": 7}
LEARNING_RATE = 1e-2
SAMPLE = {"num_samples": 3, "max_tokens": 6, "seed": 11}


def plan(vocab: int) -> dict:
    """The workload: token ids drawn once from a seeded generator (the same for every front end)."""
    import numpy as np

    rng = np.random.default_rng(1234)

    def row(length: int) -> dict:
        ids = rng.integers(3, vocab, size=length + 1).tolist()
        return {"tokens": ids[:-1], "target_tokens": ids[1:]}

    return {"model": MODEL, "steps": STEPS, "lora": LORA, "learning_rate": LEARNING_RATE,
            "batches": [[row(12), row(9)] for _ in range(STEPS)], "probe": row(10),
            "prompt": rng.integers(3, vocab, size=7).tolist(), "sample": SAMPLE}


def floats(values) -> list[float]:
    return [float(v) for v in values]


def metric(metrics: dict, *names: str) -> float:
    """The first of ``names`` in ``metrics`` (each protocol spells its metric keys its own way)."""
    for name in names:
        if name in metrics:
            return float(metrics[name])
    raise KeyError(f"none of {names} in {sorted(metrics)}")


# --- the three front ends' loops: one workload, each SDK's own types (``T``) and clients ---

def workload(T, tc, work: dict, name: str, wait) -> dict:
    """The workload on the training client ``tc`` of one SDK; ``wait(future)`` its result."""
    import numpy as np

    def datum(r):
        return T.Datum(model_input=T.ModelInput.from_ints(r["tokens"]),
                       loss_fn_inputs={"target_tokens": r["target_tokens"]})

    losses, norms = [], []
    for batch in work["batches"]:
        fb = wait(tc.forward_backward([datum(r) for r in batch], "cross_entropy"))
        losses.append(metric(fb.metrics, "loss:sum", "loss_sum"))
        step = wait(tc.optim_step(T.AdamParams(learning_rate=work["learning_rate"])))
        norms.append(metric(step.metrics, "grad_norm:mean", "grad_norm"))
    probe = wait(tc.forward([datum(work["probe"])], "cross_entropy")).loss_fn_outputs[0]["logprobs"]
    sampler = tc.save_weights_and_get_sampling_client()
    s = work["sample"]
    group = wait(sampler.sample(T.ModelInput.from_ints(work["prompt"]), s["num_samples"],
                                T.SamplingParams(max_tokens=s["max_tokens"], seed=s["seed"], stop=[])))
    state = wait(tc.save_state(f"exact-{name}"))
    return {"losses": losses, "grad_norms": norms,
            "probe_logprobs": floats(probe.to_numpy() if hasattr(probe, "to_numpy")
                                     else np.asarray(probe.data, dtype=np.float64)),
            "sample_tokens": [list(q.tokens) for q in group.sequences],
            "sample_logprobs": [floats(q.logprobs) for q in group.sequences], "state_path": state.path}


def native_loop(base_url: str, work: dict) -> dict:
    import pytrio_compat as trio

    service = trio.ServiceClient(api_key=KEY, base_url=base_url)
    try:
        tc = service.create_lora_training_client(work["model"], **work["lora"])
        return workload(trio, tc, work, "native", lambda future: future.result())
    finally:
        service.close()


def tinker_loop(base_url: str, work: dict) -> dict:
    import warnings

    import tinker

    warnings.simplefilter("ignore", FutureWarning)
    service = tinker.ServiceClient(base_url=base_url, api_key="tml-" + KEY)
    try:
        tc = service.create_lora_training_client(work["model"], **work["lora"])
        return workload(tinker.types, tc, work, "tinker", lambda future: future.result(timeout=120))
    finally:
        service.close("success").result(timeout=30)


def pytrio_loop(work: dict) -> dict:
    """Run in a child process configured only by PYTRIO_BASE_URL and PYTRIO_API_KEY, as a PyTRIO user runs it."""
    import pytrio as trio

    tc = trio.ServiceClient().create_lora_training_client(work["model"], **work["lora"])
    return workload(trio.types, tc, work, "pytrio", lambda future: future.result())


def pytrio_in_child(base_url: str, work: dict, home: Path) -> dict:
    home.mkdir(parents=True, exist_ok=True)
    (home / "plan.json").write_text(json.dumps(work))
    env = {**os.environ, "PYTRIO_BASE_URL": base_url, "PYTRIO_API_KEY": KEY, "HOME": str(home),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--pytrio-child", str(home / "plan.json"),
                           str(home / "report.json")], env=env, cwd=home, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError("the pytrio loop failed:\n" + (done.stdout + done.stderr)[-4000:])
    return json.loads((home / "report.json").read_text())


# --- the saved state's hash ---

def state_hash(storage: Path, name: str) -> dict:
    """SHA-256 over every tensor (name, dtype, shape, bytes, in name order) of the save_state checkpoint ``name``,
    per file (the adapter's weights and the optimizer's moments) and together."""
    import torch
    from safetensors import safe_open

    folders = sorted(storage.glob(f"checkpoints/*/state/{name}"))
    assert len(folders) == 1, f"expected one checkpoint named {name}, found {folders}"
    out, total = {}, hashlib.sha256()
    for path in sorted(folders[0].glob("*.safetensors")):
        digest = hashlib.sha256()
        with safe_open(str(path), framework="pt") as f:
            for key in sorted(f.keys()):
                t = f.get_tensor(key).contiguous()
                digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        out[path.name] = digest.hexdigest()
        total.update(digest.digest())
    out["all"] = total.hexdigest()
    return out


# --- the worker ---

def worker_app(model_dir: Path, storage: Path):
    import torch

    from server_mock.app import create_app
    from server_mock.service.worker import WorkerService

    return create_app(WorkerService({MODEL: str(model_dir)}, storage, "cpu", torch.float32), [KEY])


def run() -> dict:
    import torch
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
    from benchmarks.common import serve_app
    from server_mock.engine.tiny_model import make_tiny_model

    torch.set_num_threads(1)  # the same reduction order on every run
    with tempfile.TemporaryDirectory(prefix="exactness-") as tmp:
        tmp = Path(tmp)
        model_dir = make_tiny_model(tmp / "model", seed=0)
        work = plan(len(AutoTokenizer.from_pretrained(str(model_dir))))
        storage = tmp / "storage"
        with serve_app(worker_app(model_dir, storage)) as base_url:
            report = {"native": native_loop(base_url, work), "tinker": tinker_loop(base_url, work),
                      "pytrio": pytrio_in_child(base_url, work, tmp / "pytrio-home")}
        for front, part in report.items():
            part.pop("state_path")
            part["state_sha256"] = state_hash(storage, f"exact-{front}")
    return {"workload": {"steps": STEPS, "lora": LORA, "learning_rate": LEARNING_RATE, "sample": SAMPLE},
            "fronts": report}


def differences(a, b, where: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += differences(a[k], b[k], f"{where}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "exactness.json", help="where to save the report")
    parser.add_argument("--compare", type=Path, help="a saved report: exit 1 unless this run is identical to it")
    parser.add_argument("--pytrio-child", nargs=2, metavar=("PLAN", "REPORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pytrio_child:
        work = json.loads(Path(args.pytrio_child[0]).read_text())
        Path(args.pytrio_child[1]).write_text(json.dumps(pytrio_loop(work)))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    fronts = report["fronts"]
    print(json.dumps({f: {"losses": p["losses"], "grad_norms": p["grad_norms"], "state": p["state_sha256"]["all"]}
                      for f, p in fronts.items()}, indent=1))
    if args.compare:
        diffs = differences(json.loads(args.compare.read_text()), report)
        print(f"compared with {args.compare}: " + ("identical" if not diffs else f"{len(diffs)} differences"))
        for line in diffs[:40]:
            print("  " + line)
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
