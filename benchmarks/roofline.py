"""Roofline of sampling (and forward/backward) on this machine, in one process: what the hardware does, what
a decode step costs in FLOPs and bytes, and how close the sampler gets.

1. **Peaks**: matmul FLOP/s in float32 and bfloat16, large square (2048^3) and decode-shaped (rows x hidden x
   intermediate, rows x hidden x vocab for the output head, at 1, 8 and 32 rows), and the memory read bandwidth
   (a sum over 256 MiB). Each case is timed in turn, repeatedly, and the median kept.
2. **Arithmetic** of one decode step of the model (SmolLM2-135M by default) per layer: the projections, the
   attention over the cache, the LoRA side paths (rank r on every projection and the head, the worker's default),
   and the output head; and the bytes a step must read (the weights once, the KV cache).
3. **Achieved**: the sampler on a GRPO group (1 prompt x 8) and on the async recipe's coalesced batch (4 prompts
   x 8), against raw ``generate(num_return_sequences=8)`` and against the previous decode loop
   (``benchmarks/decode_baseline.py``), each as tokens/s, useful FLOP/s and a fraction of the large float32
   matmul peak; and ``forward_backward`` on the demo's batch (prefix sharing on) the same way.
4. **Profile** of a 32-row decode step (``benchmarks/decode_profile.py``).

The machine is shared, so every comparison is interleaved (A, B, A, B ...) in this one process and medians are
reported; the load average at start and end is recorded. Results: ``benchmarks/results/roofline.json``.

    python benchmarks/roofline.py [--tokens 32] [--repeats 3] [--skip-train] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import SMOLLM2, few_shot_prompt, median, save  # noqa: E402

RANK = 16
QUESTIONS = ("What is 36 + 47?", "What is 12 + 85?", "What is 64 + 29?", "What is 53 + 18?")


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def interleaved(cases: dict, repeats: int, inner: int = 1) -> dict[str, float]:
    """Median seconds of each case, the cases run in turn ``repeats`` times (each timing ``inner`` calls)."""
    for fn in cases.values():
        fn()  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            runs[name].append(min(timed(fn, inner)))
    return {name: median(t) for name, t in runs.items()}


# --- 1. peaks ---------------------------------------------------------------------------------------------


def peaks(hidden: int, inter: int, vocab: int, repeats: int) -> dict:
    torch.manual_seed(0)
    cases, flops = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
        cases[f"{tag} 2048^3"] = lambda a=a, b=b: a @ b
        flops[f"{tag} 2048^3"] = 2 * 2048 ** 3
        w_mlp, w_head = torch.randn(inter, hidden, dtype=dtype), torch.randn(vocab, hidden, dtype=dtype)
        for rows in (1, 8, 32):
            x = torch.randn(rows, hidden, dtype=dtype)
            cases[f"{tag} {rows}x{hidden}x{inter}"] = lambda x=x, w=w_mlp: torch.nn.functional.linear(x, w)
            flops[f"{tag} {rows}x{hidden}x{inter}"] = 2 * rows * hidden * inter
            cases[f"{tag} head {rows}x{hidden}x{vocab}"] = lambda x=x, w=w_head: torch.nn.functional.linear(x, w)
            flops[f"{tag} head {rows}x{hidden}x{vocab}"] = 2 * rows * hidden * vocab
    big = torch.randn(64 * 1024 * 1024)
    cases["read 256 MiB"] = lambda: big.sum()
    seconds = interleaved(cases, repeats, inner=3)
    out = {name: {"gflops": flops[name] / s / 1e9, "ms": s * 1e3} for name, s in seconds.items() if name in flops}
    out["read 256 MiB"] = {"gb_per_s": big.numel() * 4 / seconds["read 256 MiB"] / 1e9}
    return out


# --- 2. arithmetic ------------------------------------------------------------------------------------------


def projections(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each Linear of one decoder layer of a Llama-like model."""
    h, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
            "up_proj": (h, inter), "down_proj": (inter, h)}


def step_arithmetic(config, rows: int, context: int, rank: int = RANK, lora_head: bool = True,
                    bytes_per_weight: int = 4) -> dict:
    """FLOPs and bytes of one decode step: ``rows`` new tokens, each attending over ``context`` cached ones."""
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    proj = projections(config)
    per_layer = {name: 2 * rows * i * o for name, (i, o) in proj.items()}
    # QK^T and PV: 2 * heads * head_dim * context each, per row
    per_layer["attention"] = 4 * rows * config.num_attention_heads * head_dim * context
    per_layer["lora"] = sum(2 * rows * rank * (i + o) for i, o in proj.values()) if rank else 0
    head = 2 * rows * h * vocab
    head_lora = 2 * rows * rank * (h + vocab) if rank and lora_head else 0
    layer_total = sum(per_layer.values())
    weights = layers * sum(i * o for i, o in proj.values()) + h * vocab
    kv_bytes = rows * context * layers * 2 * config.num_key_value_heads * head_dim * 4
    total = layers * layer_total + head + head_lora
    return {"rows": rows, "context": context, "per_layer_flop": per_layer, "layers": layers,
            "head_flop": head, "head_lora_flop": head_lora, "total_flop": total,
            "weight_bytes": weights * bytes_per_weight, "kv_bytes": kv_bytes,
            "flop_per_byte": total / (weights * bytes_per_weight + kv_bytes)}


# --- 3. achieved --------------------------------------------------------------------------------------------


def load(model_name: str):
    from pytrio_compat.wire import LoraSpec
    from server_mock.config import TrainOptions
    from server_mock.engine.local_host import LocalModelHost

    host = LocalModelHost("bench", model_name, "cpu", torch.float32, 8192, TrainOptions())
    adapter = host.create_adapter("bench", LoraSpec(rank=RANK, seed=0))
    with torch.no_grad():  # a trained-looking adapter (B = 0 at init would make LoRA a no-op numerically)
        gen = torch.Generator().manual_seed(0)
        for name, p in adapter.params.items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
    return host, adapter


def sampling(host, adapter, tokens: int, repeats: int) -> dict:
    """Raw generate vs the previous loop vs the current one, per GRPO shape, interleaved."""
    from benchmarks.decode_baseline import baseline_generate_batch
    from benchmarks.sampling_throughput import raw_generate
    from server_mock.sampling.generate import SampleSpec, generate_batch

    snapshot = host.snapshot(adapter)
    model = host.sampling_model(snapshot)
    merged = host.decode_model(snapshot)
    tok = host.tokenizer
    prompts = [few_shot_prompt(tok, q) for q in QUESTIONS]
    out = {}
    for n_prompts in (1, 4):
        def specs(n=n_prompts):
            return [SampleSpec(prompt_tokens=p, num_samples=8, max_tokens=tokens, seed=i, stop_token_ids=[])
                    for i, p in enumerate(prompts[:n])]
        cases = {"current": lambda s=specs: generate_batch(merged, s(), tok),
                 "previous_loop": lambda s=specs: baseline_generate_batch(model, s())}
        if n_prompts == 1:
            cases["raw_generate"] = lambda: raw_generate(model, prompts[0], 8, tokens)
        else:
            cases["raw_generate"] = lambda: [raw_generate(model, p, 8, tokens) for p in prompts]
        with torch.no_grad():
            seconds = interleaved(cases, repeats)
        rows = 8 * n_prompts
        context = len(prompts[0]) + tokens // 2
        flop = step_arithmetic(host.model.config, rows, context)["total_flop"] * tokens
        out[f"{n_prompts}x8"] = {
            "seconds": seconds, "tokens_per_s": {k: rows * tokens / v for k, v in seconds.items()},
            "speedup_vs_raw_generate": seconds["raw_generate"] / seconds["current"],
            "speedup_vs_previous_loop": seconds["previous_loop"] / seconds["current"],
            "useful_gflop": flop / 1e9, "prompt_tokens": len(prompts[0])}
        print(out[f"{n_prompts}x8"], flush=True)
    return out


def decode_only(host, adapter, tokens: int, repeats: int) -> dict:
    """The decode part alone (prefill excluded) of each GRPO shape, current and previous loop interleaved: ms per
    step and achieved GFLOP/s (useful FLOPs: the rows of the batch, at the mean context)."""
    from benchmarks.decode_baseline import baseline_generate_batch
    from server_mock.sampling.generate import SampleSpec, generate_batch

    snapshot = host.snapshot(adapter)
    merged = host.decode_model(snapshot)  # the worker's default for a float32 model: the LoRA merged
    model = host.sampling_model(snapshot)  # the PEFT slot, LoRA unmerged
    prompts = [few_shot_prompt(host.tokenizer, q) for q in QUESTIONS]
    out = {}
    for n_prompts in (1, 4):
        specs = [SampleSpec(prompt_tokens=p, num_samples=8, max_tokens=tokens, seed=i, stop_token_ids=[])
                 for i, p in enumerate(prompts[:n_prompts])]
        cases = (("current", merged, generate_batch), ("current_unmerged", model, generate_batch),
                 ("previous_loop", model, baseline_generate_batch))
        runs: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        for i in range(repeats + 1):  # the first round warms up
            for name, m, fn in cases:
                timings: dict[str, float] = {}
                with torch.no_grad():
                    fn(m, specs, timings=timings)
                if i:
                    runs[name].append(timings["decode"])
        steps = tokens - 1  # the first token comes from the prefill's logits
        flop = step_arithmetic(host.model.config, 8 * n_prompts, len(prompts[0]) + tokens // 2)["total_flop"] * steps
        out[f"{n_prompts}x8"] = {name: {"decode_s": median(t), "step_ms": median(t) / steps * 1e3,
                                        "gflops": flop / median(t) / 1e9} for name, t in runs.items()}
        out[f"{n_prompts}x8"]["speedup"] = median(runs["previous_loop"]) / median(runs["current"])
        print({f"decode {n_prompts}x8": out[f"{n_prompts}x8"]}, flush=True)
    return out


def training(host, adapter, repeats: int) -> dict:
    """forward_backward on the demo's 32 datums (prefix sharing on): GFLOP/s from the tokens it runs."""
    from benchmarks.prefix_shared_training import arithmetic, call, make_batch

    data = make_batch("demo", host.tokenizer, host.vocab_size, 0)
    plan = arithmetic(host, data)
    host.prefix_sharing = True
    call(host, adapter, data, "shared")
    seconds = median(timed(lambda: call(host, adapter, data, "shared"), repeats))
    return {"seconds": seconds, "gflop": plan["gflop_shared"], "gflops": plan["gflop_shared"] / seconds,
            "tokens_shared_padded": plan["tokens_shared_padded"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per sample")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--quick", action="store_true", help="peaks, arithmetic and the profile only")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from benchmarks import decode_profile

    result: dict = {"load_average_at_start": os.getloadavg(), "torch_threads": torch.get_num_threads()}
    host, adapter = load(args.model)
    config = host.model.config
    result["peaks"] = peaks(config.hidden_size, config.intermediate_size, config.vocab_size, args.repeats)
    print(result["peaks"], flush=True)
    peak = result["peaks"]["float32 2048^3"]["gflops"]
    result["arithmetic"] = {f"{rows} rows": step_arithmetic(config, rows, 190) for rows in (1, 8, 32)}
    result["profile"] = decode_profile.profile(host, adapter, rows_per_prompt=8, prompts=4, steps=8,
                                               repeats=args.repeats)
    result["profile_8_rows"] = decode_profile.profile(host, adapter, rows_per_prompt=8, prompts=1, steps=8,
                                                      repeats=args.repeats)
    print(result["profile"], result["profile_8_rows"], flush=True)
    result["merged_lora_precision"] = decode_profile.merged_precision(host, adapter)
    print(result["merged_lora_precision"], flush=True)
    if not args.quick:
        result["sampling"] = sampling(host, adapter, args.tokens, args.repeats)
        result["decode"] = decode_only(host, adapter, args.tokens, args.repeats)
        for shape in result["decode"].values():
            for name in ("current", "current_unmerged", "previous_loop"):
                shape[name]["fraction_of_f32_peak"] = shape[name]["gflops"] / peak
        if not args.skip_train:
            result["forward_backward"] = training(host, adapter, args.repeats)
            result["forward_backward"]["fraction_of_f32_peak"] = result["forward_backward"]["gflops"] / peak
    # the peaks again: on a shared machine the load moves during the run; fractions use the higher measurement
    result["peaks_at_end"] = peaks(config.hidden_size, config.intermediate_size, config.vocab_size, args.repeats)
    peak = max(peak, result["peaks_at_end"]["float32 2048^3"]["gflops"])
    result["f32_peak_gflops"] = peak
    for shape in result.get("decode", {}).values():
        for name in ("current", "current_unmerged", "previous_loop"):
            shape[name]["fraction_of_f32_peak"] = shape[name]["gflops"] / peak
    if "forward_backward" in result:
        result["forward_backward"]["fraction_of_f32_peak"] = result["forward_backward"]["gflops"] / peak
    result["load_average_at_end"] = os.getloadavg()
    save("roofline", result)
    return result


if __name__ == "__main__":
    main()
