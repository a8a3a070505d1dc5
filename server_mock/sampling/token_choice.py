"""Choosing each sample row's next token: per-row seeded generators, temperature / top-k / top-p, stop strings.

The logprob returned for a token is always that of the unmodified model distribution (float32 log_softmax of
the raw logits); temperature, top-k and top-p only shape the distribution the token is drawn from.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["filtered_probs", "next_tokens", "row_seed", "stop_string_hit"]


TINY_TEMPERATURE = 1e-20  # below it, temperature scales each logit's gap to the row's best one, in float64


def row_seed(seed: int, row: int) -> int:
    """The generator seed of sample row ``row`` for request seed ``seed`` (a 63-bit int)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(row)])
    return int(ss.generate_state(1, dtype=np.uint64)[0]) & 0x7FFFFFFFFFFFFFFF


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling probabilities from float32 logits ``(B, V)``: temperature, then top-k, then top-p."""
    if temperature < TINY_TEMPERATURE:  # logits / temperature would overflow float32 (or divide by 0)
        scaled = ((logits - logits.amax(dim=-1, keepdim=True)).double() / temperature).float()
    else:
        scaled = logits / temperature if temperature != 1.0 else logits
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(dim=-1)
        # Keep a token when the mass strictly before it is < top_p: the smallest prefix reaching top_p; the
        # first token is always kept.
        remove_sorted = (cum - sorted_p) >= top_p
        remove_sorted[:, 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
        probs = probs.masked_fill(remove, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def stop_string_hit(tokenizer, completion: list[int], stop_strings: list[str], window: int) -> bool:
    """Whether the decoded tail of the completion contains a stop string (a new one ends there)."""
    text = tokenizer.decode(
        completion[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return any(s in text for s in stop_strings)


def next_tokens(specs, rows, live: list[int], step_logits: torch.Tensor):
    """Sample one token for each live row (``live`` indexes ``rows`` in ``step_logits`` row order)."""
    lp_all = torch.log_softmax(step_logits, dim=-1)  # the unmodified model distribution
    next_tok = torch.empty(len(live), dtype=torch.long, device=step_logits.device)
    for i, spec in enumerate(specs):
        block = [b for b, r in enumerate(live) if rows[r].request == i]
        if not block:
            continue
        banned = getattr(spec, "banned_token_ids", None)
        if spec.temperature == 0:
            choice = lp_all[block]
            if banned:
                choice = choice.index_fill(-1, torch.tensor(banned, device=choice.device), float("-inf"))
            next_tok[block] = choice.argmax(dim=-1)
            continue
        top_k = spec.top_k if spec.top_k and spec.top_k > 0 else 0
        plain = spec.temperature == 1.0 and top_k == 0 and spec.top_p >= 1.0
        logits = step_logits[block]
        if banned:  # drawn from the rest of the distribution; the logprob returned is still the model's
            logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
            plain = False
        probs = lp_all[block].exp() if plain else filtered_probs(logits, spec.temperature, top_k, spec.top_p)
        for j, b in enumerate(block):
            next_tok[b] = torch.multinomial(probs[j], 1, generator=rows[live[b]].generator)[0]
    return next_tok, lp_all.gather(-1, next_tok[:, None])[:, 0]
