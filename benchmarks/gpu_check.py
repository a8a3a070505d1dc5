"""GPU check: sampling tokens/s, forward_backward tokens/s and MFU in bf16, weight-sync latency.

No downloads are possible on the lent GPU machines, so the model is randomly initialised from a
Qwen2.5-0.5B-sized config (the speed of a model does not depend on its weights) with the tiny tokenizer.
Token ids are drawn at random; nothing is decoded. ``--size tiny`` runs the same script on a CPU in seconds.

    python benchmarks/gpu_check.py [--size qwen2.5-0.5b|tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
SIZES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True),
}


def make_model(folder: Path, size: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from server_mock.tiny_model import build_tiny_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SIZES[size]), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="qwen2.5-0.5b", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = parser.parse_args(argv)

    import torch

    import pytrio_compat as trio

    tmp = Path(tempfile.mkdtemp())
    params = make_model(tmp / "model", args.size)
    vocab = SIZES[args.size]["vocab_size"]
    trio.configure(embedded_worker_args=("--device", args.device, "--dtype", "bfloat16"))
    service = trio.ServiceClient()
    tc = service.create_lora_training_client(str(tmp / "model"), rank=32, seed=0)
    rng = np.random.default_rng(0)
    report: dict = {"size": args.size, "params": params, "device": args.device,
                    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}

    # weight sync: in-memory snapshot and a sampler on it
    sync = []
    for _ in range(5):
        t = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()
        sync.append(time.perf_counter() - t)
    report["weight_sync_s_median"] = float(np.median(sync[1:]))

    # sampling: 8 prompts x 8 samples x 256 tokens, sent together (decoded as one batch)
    import asyncio

    prompts = [rng.integers(3, vocab, 256).tolist() for _ in range(8)]
    params_s = trio.SamplingParams(max_tokens=256, temperature=1.0, stop=[])

    async def burst():
        return await asyncio.gather(*[sampler.sample_async(trio.ModelInput.from_ints(p), num_samples=8,
                                                           sampling_params=params_s, return_text=False)
                                      for p in prompts])

    asyncio.run(burst())  # warm-up
    t = time.perf_counter()
    out = asyncio.run(burst())
    elapsed = time.perf_counter() - t
    produced = sum(len(s.tokens) for r in out for s in r.sequences)
    report["sampling_tokens_per_s"] = produced / elapsed

    # forward_backward: 64 sequences x 512 tokens, importance sampling
    data = []
    for _ in range(64):
        ids = rng.integers(3, vocab, 513).tolist()
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "logprobs": [-1.0] * 512,
                                               "advantages": rng.normal(size=512).astype(np.float32)}))
    tc.forward_backward(data[:4], "importance_sampling").result()
    t = time.perf_counter()
    tc.forward_backward(data, "importance_sampling").result()
    elapsed = time.perf_counter() - t
    tokens = 64 * 512
    report["forward_backward_tokens_per_s"] = tokens / elapsed
    # frozen base + LoRA: forward 2N, backward through activations 2N flops per token (no base weight grads)
    flops = 4 * params * tokens
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if report["gpu"] and k in report["gpu"]), None)
    report["forward_backward_tflops"] = flops / elapsed / 1e12
    report["mfu"] = report["forward_backward_tflops"] / peak if peak else None
    t = time.perf_counter()
    tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
    report["optim_step_s"] = time.perf_counter() - t
    service.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
