"""Many LoRA runs sampling one base model at once: one mixed-adapter decode batch against one adapter at a time
(each adapter's requests in a batch of their own, on its merged weights: what the worker did before mixed batches)
and against the same batch with no adapter, in one process, on the worker's own ``SamplingSession``.

N runs (1, 2, 4, 8, 16) each send one request of 8 rows and 32 greedy tokens (no stop), the few-shot prompt of the
other benchmarks (~175 tokens). Reported per N: decode tokens/s of each mode (the decode clock of the batch) and
the end-to-end tokens/s with prefill, the mean per-request latency (a run served one at a time waits for those
before it), the mixed batch's speed-up over one at a time and its share of the no-adapter tokens/s. Also: a lone
request on the merged path (what a batch of one adapter decodes on) against the mixed decoder with one slot, the
--batch-invariant path's cost, where a decode step's time goes (torch.profiler by op), and the adapter pool's
load / evict times with 64 adapters resident.

    python benchmarks/multi_lora.py [--model PATH|random-smollm2] [--runs 1,2,4,8,16] [--rank 32] [--rounds 2]
                                    [--device cpu|cuda] [--dtype float32|bfloat16]

``--model random-smollm2``: a randomly initialised model of SmolLM2-135M's shape with the tiny tokenizer (for the
GPU machines, which cannot download; decode speed does not depend on the weights).

Modes are interleaved within a round and each keeps its best round (the machine may be shared). The same 8 x 8
end to end, through the SDK over HTTP against a worker in its own process with default flags (the acceptance
check): ``benchmarks/multi_lora_sdk.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from benchmarks.common import SMOLLM2, few_shot_prompt, save
from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.adapter_pool import AdapterPool
from server_mock.engine.local_host import LocalModelHost
from server_mock.lora import Snapshot, model_layout
from server_mock.sampling.generate import SampleSpec

ROWS, TOKENS = 8, 32


SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)


def random_smollm2(folder: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from server_mock.engine.tiny_model import build_tiny_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _snapshots(host: LocalModelHost, n: int, rank: int, prefix: str = "run") -> list:
    """``n`` snapshots of random LoRA weights in PEFT's layout on every layer a default LoraSpec covers (A as
    PEFT initialises it, B the size some training gives: a fresh LoRA's B is zero)."""
    spec = LoraSpec(rank=rank)
    targets = host.lora_targets(spec)
    layout = model_layout(host.model, host._linear_groups)
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for name in targets:
            n_in, n_out = layout[name].in_features, layout[name].out_features
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
        out.append(Snapshot(f"{prefix}-{rank}-{i}", spec, targets, tensors))
    return out


def _spec(prompt: list[int], i: int) -> SampleSpec:
    return SampleSpec(prompt_tokens=prompt, num_samples=ROWS, max_tokens=TOKENS, seed=i, temperature=0.0,
                      stop_token_ids=[])


class PlainBase(nn.Module):
    """The base model with its plain layers in place of PEFT's for each call (the no-adapter baseline: PEFT's
    ``disable_adapter`` costs a pass over the modules per forward, which a batch without LoRA need not pay)."""

    def __init__(self, host: LocalModelHost) -> None:
        super().__init__()
        self.inner = host.model
        self.config = host.model.config
        self._swaps = [(parent, attr, mixed.base) for parent, attr, mixed in host.mixed_decoder()._swaps]

    def forward(self, *args, **kwargs):
        saved = [(parent, attr, parent._modules[attr]) for parent, attr, _ in self._swaps]
        try:
            for parent, attr, plain in self._swaps:
                parent._modules[attr] = plain
            return self.inner(*args, **kwargs)
        finally:
            for parent, attr, module in saved:
                parent._modules[attr] = module


def _session_run(host, first, requests, model=None) -> tuple[float, float, list[float]]:
    """(wall s, decode s, per-request latency s) of one session given ``requests`` [(spec, snapshot)]."""
    started = time.perf_counter()
    session = host.sampling_session(first)
    if model is not None:
        session.model, session.merged = model, True  # kept for the session (as a merged decoder is)
        session.batch.use_model(model)
    handles = {session.add(spec, snap): i for i, (spec, snap) in enumerate(requests)}
    latency = [0.0] * len(requests)
    while session.active:
        for handle, _, _ in session.run(lambda: False):
            latency[handles[handle]] = time.perf_counter() - started
    return time.perf_counter() - started, session.batch.decode_s, latency


def mixed(host, snaps, prompts):
    return _session_run(host, snaps[0], [(_spec(p, i), s) for i, (p, s) in enumerate(zip(prompts, snaps))])


def one_at_a_time(host, snaps, prompts):
    wall = decode = 0.0
    latency = []
    for i, (p, s) in enumerate(zip(prompts, snaps)):
        w, d, lat = _session_run(host, s, [(_spec(p, i), s)])
        latency.append(wall + lat[0])
        wall, decode = wall + w, decode + d
    return wall, decode, latency


def no_adapter(host, snaps, prompts):
    return _session_run(host, None, [(_spec(p, i), None) for i, p in enumerate(prompts)], PlainBase(host))


def lone_mixed(host, snap, prompt):
    """A lone request on the mixed decoder (one slot) rather than its merged weights."""
    started = time.perf_counter()
    session = host.sampling_session(snap)
    session._go_mixed()
    session.add(_spec(prompt, 0))
    while session.active:
        session.run(lambda: False)
    return time.perf_counter() - started, session.batch.decode_s, []


def profile_step(host, snaps, prompts, label: str) -> dict:
    """Where one decode step's time goes: torch.profiler's self CPU time by op, over 4 steps of the batch."""
    session = host.sampling_session(snaps[0] if snaps else None)
    for i, p in enumerate(prompts):
        session.add(_spec(p, i), snaps[i] if snaps else None)
    session.run(lambda: True)  # the first step outside the profile
    count = [0]

    def stop():
        count[0] += 1
        return count[0] >= 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        session.run(stop)
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    groups = {"base matmuls (addmm/mm/linear)": ("aten::addmm", "aten::mm", "aten::linear"),
              "LoRA batched matmuls (bmm)": ("aten::bmm",), "attention (sdpa)": ("aten::_scaled_dot_product",),
              "gathers (index_select)": ("aten::index_select",)}
    out = {}
    for name, prefixes in groups.items():
        out[name] = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(prefixes)) / total
    out["everything else"] = 1.0 - sum(out.values())
    out["ms_per_step"] = total / 4 / 1000
    print(label, {k: round(v, 3) for k, v in out.items()})
    return out


def pool_times(host, snaps: list) -> dict:
    """Load all but one of ``snaps`` into a pool sized for them (each load timed), then evict and reload one."""
    count, rank = len(snaps) - 1, snaps[0].spec.rank
    probe = AdapterPool(1 << 40, host.dtype, host.device)
    size = probe.get(snaps[0]).nbytes
    pool = AdapterPool(count * size, host.dtype, host.device)
    for snap in snaps[:count]:
        pool.get(snap)
    loads = sorted(pool.stats.load_seconds)
    started = time.perf_counter()
    pool.get(snaps[count])  # one more: the least recently used is evicted
    evict_and_load = time.perf_counter() - started
    started = time.perf_counter()
    pool.get(snaps[0])  # the evicted one, back on demand
    reload = time.perf_counter() - started
    return {"adapters_resident": len(pool), "rank": rank, "bytes_per_adapter": size, "pool_bytes": pool.nbytes,
            "load_ms_median": 1000 * loads[len(loads) // 2], "load_ms_max": 1000 * loads[-1],
            "evict_and_load_ms": 1000 * evict_and_load, "reload_evicted_ms": 1000 * reload,
            "evictions": pool.stats.evictions}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=SMOLLM2)
    parser.add_argument("--runs", default="1,2,4,8,16")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--pool-adapters", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-invariant", dest="invariant", action="store_false",
                        help="skip the --batch-invariant measurement")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    began = time.perf_counter()
    if args.model == "random-smollm2":
        import tempfile

        args.model = random_smollm2(Path(tempfile.mkdtemp()) / "smollm2-shape")
    host = LocalModelHost("smol", args.model, args.device, dtype, 8192, TrainOptions())
    inv = (LocalModelHost("smol", args.model, args.device, dtype, 8192, TrainOptions(batch_invariant=True))
           if args.invariant else None)
    runs = [int(n) for n in args.runs.split(",")]
    questions = [f"What is {11 + 3 * i} + {20 + 7 * i}?" for i in range(max(runs))]
    if getattr(host.tokenizer, "chat_template", None):
        prompts = [few_shot_prompt(host.tokenizer, q) for q in questions]
    else:  # the tiny tokenizer: random ids of the prompt's length
        prompts = [torch.randint(3, 500, (175,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(len(questions))]
    snaps = _snapshots(host, max(runs), args.rank)
    inv_snaps = snaps  # the same tensors: snapshots are plain data
    pool_snaps = _snapshots(host, args.pool_adapters + 1, 8, prefix="pool")
    print(f"{time.perf_counter() - began:.0f}s set up", flush=True)
    with torch.no_grad():
        lone = {"merged": [], "mixed_one_slot": []}
        table = {n: {"mixed": [], "one_at_a_time": [], "no_adapter": [], "batch_invariant": []} for n in runs}
        _session_run(host, snaps[0], [(_spec(prompts[0], 0), snaps[0])])  # warm up
        for _ in range(args.rounds):
            for _ in range(3):  # short: three each a round
                lone["merged"].append(_session_run(host, snaps[0], [(_spec(prompts[0], 0), snaps[0])]))
                lone["mixed_one_slot"].append(lone_mixed(host, snaps[0], prompts[0]))
            print("lone", [round(v[0], 3) for v in lone["merged"]], [round(v[0], 3) for v in lone["mixed_one_slot"]],
                  flush=True)
            for n in runs:
                for mode, fn in (("mixed", mixed), ("one_at_a_time", one_at_a_time), ("no_adapter", no_adapter)):
                    table[n][mode].append(fn(host, snaps[:n], prompts[:n]))
                if n == 8 and args.invariant:
                    table[n]["batch_invariant"].append(mixed(inv, inv_snaps[:n], prompts[:n]))
                print(f"{time.perf_counter() - began:.0f}s runs", n,
                      {mode: [round(v[1], 3) for v in vals] for mode, vals in table[n].items()},
                      flush=True)  # decode seconds so far, per mode
                if args.out:  # what is measured so far, in case the run is cut short
                    Path(args.out + ".partial").write_text(repr({k: v for k, v in table.items()}))
        profiles = {}
        if args.device == "cpu" and max(runs) >= 8:  # CPU self time by op (a GPU's kernels run asynchronously)
            profiles = {"mixed_8x8": profile_step(host, snaps[:8], prompts[:8], "mixed 8x8"),
                        "no_adapter_8x8": profile_step(host, [], prompts[:8], "no adapter 8x8"),
                        "one_adapter_8_rows": profile_step(host, snaps[:1], prompts[:1], "one adapter, 8 rows")}
    rows = []
    for n in runs:
        best = {mode: min(vals, key=lambda v: v[1]) for mode, vals in table[n].items() if vals}
        tokens = n * ROWS * TOKENS
        row = {"runs": n, "rows": n * ROWS}
        for mode, (wall, decode, latency) in best.items():
            row[f"{mode}_decode_tok_s"] = tokens / decode
            row[f"{mode}_e2e_tok_s"] = tokens / wall
            row[f"{mode}_mean_latency_s"] = sum(latency) / len(latency)
        row["mixed_vs_one_at_a_time"] = row["mixed_decode_tok_s"] / row["one_at_a_time_decode_tok_s"]
        row["mixed_e2e_vs_one_at_a_time"] = row["mixed_e2e_tok_s"] / row["one_at_a_time_e2e_tok_s"]
        row["mixed_share_of_no_adapter"] = row["mixed_decode_tok_s"] / row["no_adapter_decode_tok_s"]
        if "batch_invariant" in best:
            row["batch_invariant_vs_one_at_a_time"] = (row["batch_invariant_decode_tok_s"]
                                                       / row["one_at_a_time_decode_tok_s"])
        rows.append(row)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    lone_best = {mode: min(vals, key=lambda v: v[0]) for mode, vals in lone.items()}
    lone_out = {"merged_s": lone_best["merged"][0], "mixed_one_slot_s": lone_best["mixed_one_slot"][0],
                "mixed_one_slot_vs_merged": lone_best["mixed_one_slot"][0] / lone_best["merged"][0]}
    print("lone request", lone_out)
    pool = pool_times(host, pool_snaps)
    print("pool", pool)
    payload = {"model": args.model, "dtype": args.dtype, "device": args.device, "rank": args.rank, "rows": ROWS,
               "tokens": TOKENS, "prompt_tokens": len(prompts[0]), "rounds": args.rounds, "table": rows,
               "lone_request": lone_out, "profile": profiles, "pool": pool}
    if args.out:
        Path(args.out).write_text(__import__("json").dumps(payload, indent=1))
    save(f"multi_lora_{args.device}_{args.dtype}", payload)


if __name__ == "__main__":
    main()
