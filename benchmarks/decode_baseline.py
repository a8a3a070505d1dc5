"""The sampler's decode loop as it was before the in-place cache and the vectorised token choice, kept as the
same-process baseline of ``benchmarks/roofline.py`` (never used by the worker).

What it does per step, and what the current loop (``server_mock/sampling/decode_batch.py``) changed: the
cache's full-attention layers append with ``torch.cat`` (the whole history copied each step; now written in
place); each stopped row is dropped at once with ``Cache.reorder_cache`` (now: when a quarter of the rows are
dead); each sampled row draws with ``torch.multinomial`` and its own generator, whose ``exponential_`` runs
element by element (now: one vectorised ``torch.rand`` per row, the same exponential race); tokens and logprobs
come to the host in two transfers (now one). Only the full path (shared prefix, padded batch) is kept.
"""

from __future__ import annotations

import random
import time

import torch

from server_mock.sampling.logprobs import EvalMode
from server_mock.sampling.token_choice import filtered_probs, row_seed

__all__ = ["baseline_generate_batch"]


def _next_tokens(specs, rows, live, step_logits):
    lp_all = torch.log_softmax(step_logits, dim=-1)
    next_tok = torch.empty(len(live), dtype=torch.long, device=step_logits.device)
    for i, spec in enumerate(specs):
        block = [b for b, r in enumerate(live) if rows[r][0] == i]
        if not block:
            continue
        if spec.temperature == 0:
            next_tok[block] = lp_all[block].argmax(dim=-1)
            continue
        top_k = spec.top_k if spec.top_k and spec.top_k > 0 else 0
        plain = spec.temperature == 1.0 and top_k == 0 and spec.top_p >= 1.0
        probs = lp_all[block].exp() if plain else filtered_probs(step_logits[block], spec.temperature, top_k,
                                                                 spec.top_p)
        for j, b in enumerate(block):
            next_tok[b] = torch.multinomial(probs[j], 1, generator=rows[live[b]][1])[0]
    return next_tok, lp_all.gather(-1, next_tok[:, None])[:, 0]


def _forward(model, ids, cache, keep, mask=None, positions=None):
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep, attention_mask=mask,
                position_ids=positions)
    return out.logits, out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def baseline_generate_batch(model, specs, timings: dict | None = None) -> list[list[list[int]]]:
    """Each request's sampled token rows (stop token ids honoured; no stop strings, no prompt logprobs);
    ``timings`` gets the seconds of the prefill and of the decode."""
    started = time.perf_counter()
    device = next(model.parameters()).device
    rows = []  # (request, generator, tokens, logprobs)
    for i, spec in enumerate(specs):
        seed = spec.seed if spec.seed is not None else random.SystemRandom().getrandbits(63)
        for r in range(spec.num_samples):
            gen = None
            if spec.temperature != 0:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(seed, r))
            rows.append((i, gen, [], []))
    prompts = [s.prompt_tokens for s in specs]
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p, device=device)
        mask[b, longest - len(p):] = 1
    padded = any(len(p) < longest for p in prompts)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if padded else None
    mask = mask if padded else None
    with torch.no_grad(), EvalMode(model):
        logits, cache = _forward(model, ids, None, 1, mask, positions)
        step_logits = logits[:, -1, :].float()
        next_pos = torch.tensor([len(p) for p in prompts], device=device) if padded else None
        live = [r for r, row in enumerate(rows) if specs[row[0]].max_tokens > 0]
        idx = torch.tensor([rows[r][0] for r in live], device=device)
        cache.reorder_cache(idx)
        step_logits = step_logits[idx]
        if padded:
            mask, next_pos = mask[idx], next_pos[idx]
        prefilled = time.perf_counter()
        while live:
            next_tok, tok_lp = _next_tokens(specs, rows, live, step_logits)
            keep = []
            for b, (t, lp) in enumerate(zip(next_tok.tolist(), tok_lp.tolist())):
                request, _, tokens, lps = rows[live[b]]
                tokens.append(t)
                lps.append(lp)
                if t not in specs[request].stop_token_ids and len(tokens) < specs[request].max_tokens:
                    keep.append(b)
            if not keep:
                break
            live = [live[b] for b in keep]
            feed = next_tok[keep]
            if len(keep) < len(next_tok):
                idx = torch.tensor(keep, device=device)
                cache.reorder_cache(idx)
                if padded:
                    mask, next_pos = mask[idx], next_pos[idx]
            if padded:
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits, cache = _forward(model, feed[:, None], cache, 1, mask, None if not padded else next_pos[:, None])
            step_logits = logits[:, -1, :].float()
            if padded:
                next_pos = next_pos + 1
    if timings is not None:
        timings["prefill"], timings["decode"] = prefilled - started, time.perf_counter() - prefilled
    return [[row[2] for row in rows if row[0] == i] for i in range(len(specs))]
