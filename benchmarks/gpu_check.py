"""GPU check: for a dense model and the recipes' default family (Qwen3.5: linear attention mixed with full
attention), sampling tokens/s, forward_backward tokens/s and MFU in bf16, weight-sync latency, and the bf16
sampler-vs-trainer logprob gap with and without the float32 output head.

No downloads are possible on the lent GPU machines, so each model is randomly initialised from a config of the
real size (Qwen2.5-0.5B; Qwen3.5 at about 0.8B; speed does not depend on the weights) with the tiny tokenizer.
Token ids are drawn at random; nothing is decoded. ``--size tiny`` runs the same script on a CPU in seconds.

    python benchmarks/gpu_check.py [--size full|tiny] [--device cuda]
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
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=True)
# (config class, full-size config, tiny config, sampling shape (prompts, samples, tokens), training shape)
ARCHS = {
    "dense-qwen2.5-0.5b": ("Qwen2Config",
                           dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                                tie_word_embeddings=True),
                           _TINY, (8, 8, 256), (64, 512)),
    "qwen3.5-0.8b": ("Qwen3_5TextConfig",
                     dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                          linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320,
                          max_position_embeddings=32768, tie_word_embeddings=True),
                     dict(_TINY, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                          linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
                     (4, 8, 128), (32, 512)),
}


def make_model(folder: Path, arch: str, size: str) -> tuple[int, int]:
    """Write a random model of ``arch`` at ``size``; return (parameters, vocab size)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from server_mock.engine.tiny_model import build_tiny_tokenizer

    class_name, full, tiny = ARCHS[arch][:3]
    config = getattr(transformers, class_name)(**(full if size == "full" else tiny))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return sum(p.numel() for p in model.parameters()), config.vocab_size


def check_arch(service, trio, folder: Path, params: int, vocab: int, arch: str, gpu: str | None) -> dict:
    """Speed of one served model through the SDK: weight sync, a sampling burst, one big forward_backward."""
    import asyncio

    n_prompts, n_samples, n_tokens = ARCHS[arch][3]
    n_seqs, seq_len = ARCHS[arch][4]
    tc = service.create_lora_training_client(str(folder), rank=32, seed=0)
    rng = np.random.default_rng(0)
    report: dict = {"arch": arch, "params": params}
    sync = []
    for _ in range(5):
        t = time.perf_counter()
        sampler = tc.save_weights_and_get_sampling_client()
        sync.append(time.perf_counter() - t)
    report["weight_sync_s_median"] = float(np.median(sync[1:]))

    prompts = [rng.integers(3, vocab, 256).tolist() for _ in range(n_prompts)]
    params_s = trio.SamplingParams(max_tokens=n_tokens, temperature=1.0, stop=[])

    async def burst():
        return await asyncio.gather(*[sampler.sample_async(trio.ModelInput.from_ints(p), num_samples=n_samples,
                                                           sampling_params=params_s, return_text=False)
                                      for p in prompts])

    asyncio.run(burst())  # warm-up
    t = time.perf_counter()
    out = asyncio.run(burst())
    elapsed = time.perf_counter() - t
    report["sampling_shape"] = [n_prompts, n_samples, n_tokens]
    report["sampling_tokens_per_s"] = sum(len(s.tokens) for r in out for s in r.sequences) / elapsed

    data = []
    for _ in range(n_seqs):
        ids = rng.integers(3, vocab, seq_len + 1).tolist()
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                               loss_fn_inputs={"target_tokens": ids[1:], "logprobs": [-1.0] * seq_len,
                                               "advantages": rng.normal(size=seq_len).astype(np.float32)}))
    tc.forward_backward(data[:4], "importance_sampling").result()
    t = time.perf_counter()
    tc.forward_backward(data, "importance_sampling").result()
    elapsed = time.perf_counter() - t
    tokens = n_seqs * seq_len
    report["training_shape"] = [n_seqs, seq_len]
    report["forward_backward_tokens_per_s"] = tokens / elapsed
    # frozen base + LoRA: forward 2N, backward through activations 2N flops per token (no base weight grads)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if gpu and k in gpu), None)
    report["forward_backward_tflops"] = 4 * params * tokens / elapsed / 1e12
    report["mfu"] = report["forward_backward_tflops"] / peak if peak else None
    t = time.perf_counter()
    tc.optim_step(trio.AdamParams(learning_rate=1e-4)).result()
    report["optim_step_s"] = time.perf_counter() - t
    return report


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="full", choices=["full", "tiny"])
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), help="default: all")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_check.json"))
    args = parser.parse_args(argv)

    import torch

    import pytrio_compat as trio
    from benchmarks.precision_gap import measure

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    report: dict = {"size": args.size, "device": args.device, "gpu": gpu, "models": []}
    trio.configure(embedded_worker_args=("--device", args.device, "--dtype", "bfloat16"))
    service = trio.ServiceClient()
    tmp = Path(tempfile.mkdtemp())
    for arch in args.arch or list(ARCHS):
        folder = tmp / arch
        params, vocab = make_model(folder, arch, args.size)
        started = time.perf_counter()
        row = check_arch(service, trio, folder, params, vocab, arch, gpu)
        # the bf16 sampler-vs-trainer gap on random prompts, with and without the float32 head
        prompts = [np.random.default_rng(i).integers(3, vocab, 64).tolist() for i in range(4)]
        for head in (True, False):
            gap = measure(str(folder), args.device, "bfloat16", head, group=8, max_tokens=32, prompt_ids=prompts)
            row[f"bf16_gap_float32_head_{'on' if head else 'off'}"] = {
                k: gap[k] for k in ("max_abs_gap", "kl_sample_train", "mean_abs_gap", "tokens")}
        row["seconds"] = time.perf_counter() - started
        report["models"].append(row)
        print(json.dumps(row, indent=1), flush=True)
    service.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
