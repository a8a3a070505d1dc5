"""Where a decode step's time goes, by measurement rather than by profiler (the torch profiler's own overhead
inflates small ops several-fold on this machine).

At the state of a real batch (the async recipe's 4 prompts x 8 rows, after the prefill), each part is timed on
its own, interleaved with the others, and the medians compared:

* the decode loop's own phases (``DecodeBatch(profile=...)``): token choice, bookkeeping, cache compaction,
  the model forward;
* inside the forward: the forward with the LoRA unmerged (PEFT) and merged (``engine/merged_lora.py``: the same
  projections without the side paths, so the difference is what the side paths cost), the projections' and the
  head's matmuls alone on the same shapes, and the attention over the cache alone; what the merged forward
  spends beyond those is norms, rotary embeddings, activations, residual adds and Python / dispatch overhead;
* merging the LoRA into a copy of the weights (``engine/merged_lora.py``): the forward on the merged copy, the
  per-snapshot cost of computing ``W + s B A`` for every adapted layer against the per-step saving, and the
  logprob gap merged vs unmerged and of each to the trainer's forward pass (``merged_precision``).

    python benchmarks/decode_profile.py   (also run by benchmarks/roofline.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import few_shot_prompt, median, sampler_minus_trainer  # noqa: E402

QUESTIONS = ("What is 36 + 47?", "What is 12 + 85?", "What is 64 + 29?", "What is 53 + 18?")


def _rewind(cache, columns: int) -> None:
    """Put the in-place layers back to ``columns`` filled columns (the next forward overwrites the rest)."""
    for layer in cache.layers:
        if getattr(layer, "_in_place", False) and layer._in_buffer():
            layer.keys, layer.values = layer._kbuf[:, :, :columns], layer._vbuf[:, :, :columns]


def _median_interleaved(cases: dict, repeats: int) -> dict[str, float]:
    import time

    for fn in cases.values():
        fn()
    runs: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)
    return {k: median(v) for k, v in runs.items()}


def profile(host, adapter, rows_per_prompt: int = 8, prompts: int = 4, steps: int = 8, repeats: int = 3) -> dict:
    from server_mock.sampling import cache_rows
    from server_mock.sampling.batch_admission import forward
    from server_mock.sampling.decode_batch import DecodeBatch
    from server_mock.sampling.generate import SampleSpec
    from server_mock.sampling.logprobs import EvalMode
    from server_mock.sampling.token_choice import next_tokens

    snapshot = host.snapshot(adapter)
    model = host.sampling_model(snapshot)
    tok = host.tokenizer
    specs = [SampleSpec(prompt_tokens=few_shot_prompt(tok, q), num_samples=rows_per_prompt, max_tokens=steps + 1,
                        seed=i, stop_token_ids=[]) for i, q in enumerate(QUESTIONS[:prompts])]
    # 1. the loop's own phases over a real run
    phases: dict[str, float] = {}
    batch = DecodeBatch(model, tok, host.sampling_support, profile=phases)
    batch.admit(specs)
    batch.run()
    per_step = {k: v / steps * 1e3 for k, v in phases.items()}
    step_ms = sum(per_step.values())

    # 2. the forward taken apart, at the state after the prefill
    batch = DecodeBatch(model, tok, host.sampling_support)
    batch.admit(specs)
    part = batch._part
    rows, columns = len(part.rows), part.columns
    feed = torch.full((rows, 1), 5, dtype=torch.long)
    mask = None if part.mask is None else torch.cat([part.mask, part.mask.new_ones((rows, 1))], dim=1)
    positions = None if part.positions is None else part.positions[:, None]
    config = host.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers

    def run_forward():
        _rewind(part.cache, columns)
        forward(model, feed, part.cache, 1, mask, positions)

    merged = host.decode_model(snapshot)

    def run_forward_merged():
        _rewind(part.cache, columns)
        forward(merged, feed, part.cache, 1, mask, positions)

    def run_forward_base():
        _rewind(part.cache, columns)
        with host.peft.disable_adapter():
            forward(host.peft, feed, part.cache, 1, mask, positions)

    weights = []
    for module in host.model.model.layers[0].modules():
        base = getattr(module, "base_layer", None)
        if isinstance(base, torch.nn.Linear):
            weights.append(base.weight)
    head_w = host.model.get_output_embeddings()
    head_w = getattr(head_w, "base_layer", head_w).weight
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    x_head = torch.randn(rows, config.hidden_size)

    def run_matmuls():
        for _ in range(layers):
            for w in weights:
                torch.nn.functional.linear(xs[w.shape[1]], w)
        torch.nn.functional.linear(x_head, head_w)

    q = torch.randn(rows, config.num_attention_heads, 1, head_dim)
    kv = torch.randn(rows, config.num_attention_heads, columns + 1, head_dim)
    attn_mask = torch.zeros(rows, 1, 1, columns + 1, dtype=torch.bool) if mask is None else (
        mask[:, None, None, :].bool())

    def run_attention():
        for _ in range(layers):
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, attn_mask=attn_mask)

    logits = torch.randn(rows, config.vocab_size)
    live_rows = [batch.rows[r] for r in part.rows]

    def run_choice():
        next_tokens(live_rows, logits)

    keep = torch.arange(rows * 3 // 4)

    def run_compaction():
        cache = part.cache
        saved = [(layer.keys, layer.values, layer._kbuf, layer._vbuf) for layer in cache.layers]
        cache_rows.keep_rows(cache, keep)
        for layer, (k, v, kb, vb) in zip(cache.layers, saved):
            layer.keys, layer.values, layer._kbuf, layer._vbuf = k, v, kb, vb

    with torch.no_grad(), EvalMode(model):
        seconds = _median_interleaved({"forward": run_forward, "forward_merged_lora": run_forward_merged,
                                       "forward_without_lora": run_forward_base,
                                       "matmuls": run_matmuls, "attention": run_attention,
                                       "token_choice": run_choice, "compaction_to_3/4": run_compaction}, repeats)
    ms = {k: v * 1e3 for k, v in seconds.items()}
    # the merged forward does the same projections minus the LoRA paths (PEFT's disabled-adapter forward is no
    # baseline: disabling walks every module, so it is slower than the adapted forward on this model)
    lora_ms = ms["forward"] - ms["forward_merged_lora"]
    rest_ms = ms["forward_merged_lora"] - ms["matmuls"] - ms["attention"]

    # 3. merging the LoRA into a weight copy once per snapshot
    import time

    pairs = []
    for module in host.peft.modules():
        if hasattr(module, "lora_A") and snapshot is not None and module.active_adapters:
            name = module.active_adapters[0]
            if name in module.lora_A:
                pairs.append((module.base_layer.weight, module.lora_B[name].weight, module.lora_A[name].weight,
                              module.scaling[name]))
    start = time.perf_counter()
    with torch.no_grad():
        for w, b, a, scale in pairs:
            torch.addmm(w, b, a, alpha=scale)
    merge_ms = (time.perf_counter() - start) * 1e3
    merged_bytes = sum(w.numel() * w.element_size() for w, _, _, _ in pairs)

    return {"rows": rows, "context": columns, "loop_phases_ms_per_step": per_step, "loop_step_ms": step_ms,
            "parts_ms": ms,
            "forward_split_ms": {"matmuls (projections + head)": ms["matmuls"], "attention": ms["attention"],
                                 "lora side paths (unmerged)": lora_ms,
                                 "norms, rotary, activations, Python": rest_ms},
            "merge_lora_once_ms": merge_ms, "merged_copy_bytes": merged_bytes,
            "merge_pays_after_steps": merge_ms / lora_ms if lora_ms > 0 else None}


def merged_precision(host, adapter, tokens: int = 24) -> dict:
    """The 4 x 8 batch sampled merged and unmerged (same seeds): whether the tokens agree, the largest logprob
    gap between the two, and each one's largest gap to the trainer's logprobs of the same tokens."""
    import numpy as np

    from server_mock.sampling.generate import SampleSpec, generate_batch

    snapshot = host.snapshot(adapter)
    specs = [SampleSpec(prompt_tokens=few_shot_prompt(host.tokenizer, q), num_samples=8, max_tokens=tokens, seed=i,
                        stop_token_ids=[]) for i, q in enumerate(QUESTIONS)]
    merged = generate_batch(host.decode_model(snapshot), specs, host.tokenizer)
    unmerged = generate_batch(host.sampling_model(snapshot), specs, host.tokenizer)
    same = all([s.tokens for s in a.sequences] == [s.tokens for s in b.sequences] for a, b in zip(merged, unmerged))
    gap = max(abs(x - y) for a, b in zip(merged, unmerged) for s, t in zip(a.sequences, b.sequences)
              for x, y in zip(s.logprobs, t.logprobs))

    def to_trainer(results) -> float:
        return max(float(np.abs(g).max()) for g in sampler_minus_trainer(host, adapter, specs, results))

    return {"same_tokens": same, "max_gap_merged_vs_unmerged": gap, "max_gap_to_trainer_merged": to_trainer(merged),
            "max_gap_to_trainer_unmerged": to_trainer(unmerged)}


if __name__ == "__main__":
    from benchmarks.roofline import load

    host, adapter = load("HuggingFaceTB/SmolLM2-135M-Instruct")
    print(profile(host, adapter))
