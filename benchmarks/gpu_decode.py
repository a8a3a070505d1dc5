"""GPU decode check: decode tokens/s and MFU of the sampler, eager vs fixed-shape steps captured as CUDA graphs
(``--decode-graphs on``), for a dense ~0.5B model and the Qwen3.5 hybrid (linear + full attention) at 1, 8 and
32 rows, in bfloat16 with the float32 output head (the worker's defaults on a GPU).

The models are random, of the real sizes (``gpu_check.ARCHS``; nothing is downloaded on the lent machines), with
a LoRA of rank 32 loaded as a sampler snapshot. Each case: one prompt of 128 random tokens, ``rows`` samples of
128 new tokens that never stop. The graphed case runs once untimed first (compile and capture of its bucket: that
time is reported as ``compile_s``), then timed; eager and graphed runs alternate. The tokens of both paths are
compared (bf16 matmuls can round differently between a captured and an eager kernel, so a mismatch is reported,
not fatal). MFU counts 2 FLOPs per weight of every Linear layer (the head included) and the attention over the
cache of the full-attention layers, per token, against the GPU's dense bf16 peak.

    python benchmarks/gpu_decode.py [--size full|tiny] [--device cuda] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import ARCHS, PEAK_BF16_TFLOPS, make_model  # noqa: E402

ROWS = (1, 8, 32)
PROMPT, NEW = 128, 128


def flop_per_token(model, context: int) -> float:
    import torch

    linear = sum(m.weight.numel() for m in model.modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in type(m).__name__.lower())
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    full = sum(1 for t in getattr(config, "layer_types", ["full_attention"] * config.num_hidden_layers)
               if t == "full_attention")
    return 2 * linear + 4 * full * config.num_attention_heads * head_dim * context


def decode_case(host, snapshot, rows: int, static, seed: int) -> tuple[float, list]:
    """Decode seconds (prefill excluded) and the rows' tokens of one case; ``static``: StaticSteps or None."""
    import torch

    from server_mock.sampling.decode_batch import DecodeBatch
    from server_mock.sampling.generate import SampleSpec

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, host.vocab_size, (PROMPT,), generator=gen).tolist()
    spec = SampleSpec(prompt_tokens=prompt, num_samples=rows, max_tokens=NEW, seed=seed, stop_token_ids=[])
    batch = DecodeBatch(host.sampling_model(snapshot), host.tokenizer, host.sampling_support, static=static)
    batch.admit([spec])
    batch.run(lambda: False)  # one step at a time, as the worker's queue runs it
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    done = batch.take_finished()[0]
    return batch.decode_s, [row.tokens for row in done.rows]


def check(folder: Path, arch: str, device: str, gpu: str | None, repeats: int) -> dict:
    import torch

    from pytrio_compat.wire import LoraSpec
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.sampling.static_steps import StaticSteps

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    host = LocalModelHost(arch, str(folder), device, dtype)
    snapshot = host.snapshot(host.create_adapter("decode", LoraSpec(rank=32, seed=0)))
    # the worker's --decode-graphs on: compiled (a CUDA graph per bucket) on CUDA; on a CPU the fixed-shape
    # step runs eagerly (a smoke run of this script)
    static = StaticSteps(host.sampling_model(snapshot), compile=device == "cuda")
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if gpu and k in gpu), None)
    per_token = flop_per_token(host.model, PROMPT + NEW // 2)
    out = {"arch": arch, "flop_per_token": per_token, "rows": {}}
    for rows in ROWS:
        entry: dict = {}
        try:
            started = time.perf_counter()
            _, graphed_tokens = decode_case(host, snapshot, rows, static, 0)  # compile + capture of the bucket
            entry["compile_s"] = time.perf_counter() - started
            entry["same_tokens_eager_vs_graphed"] = graphed_tokens == decode_case(host, snapshot, rows, None, 0)[1]
            runs: dict[str, list[float]] = {"eager": [], "graphed": []}
            for i in range(repeats):
                runs["eager"].append(decode_case(host, snapshot, rows, None, i + 1)[0])
                runs["graphed"].append(decode_case(host, snapshot, rows, static, i + 1)[0])
            for name, times in runs.items():
                seconds = sorted(times)[len(times) // 2]
                tokens_per_s = rows * (NEW - 1) / seconds
                tflops = per_token * tokens_per_s / 1e12
                entry[name] = {"decode_s": seconds, "tokens_per_s": tokens_per_s, "tflops": tflops,
                               "mfu": tflops / peak if peak else None}
            entry["graphed_speedup"] = entry["eager"]["decode_s"] / entry["graphed"]["decode_s"]
        except Exception as exc:  # noqa: BLE001 - report and go on: one run should give every figure it can
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-3000:]
        out["rows"][rows] = entry
        print(json.dumps({arch: {rows: {k: v for k, v in entry.items() if k != "traceback"}}}), flush=True)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), help="default: all")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_decode.json"))
    args = parser.parse_args(argv)

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report: dict = {"size": args.size, "device": args.device, "gpu": gpu, "rows": ROWS, "prompt": PROMPT,
                    "new_tokens": NEW, "models": []}
    tmp = Path(tempfile.mkdtemp())
    for arch in args.arch or list(ARCHS):
        folder = tmp / arch
        params, _ = make_model(folder, arch, args.size)
        row = check(folder, arch, args.device, gpu, args.repeats)
        row["params"] = params
        report["models"].append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
