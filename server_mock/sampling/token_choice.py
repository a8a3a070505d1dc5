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


def _exponential_race(probs: torch.Tensor, generators: list) -> torch.Tensor:
    """One draw per row from ``probs`` (B, V): the argmax of ``p / E`` with ``E ~ Exp(1)`` i.i.d. picks token i with
    probability p_i (the method ``torch.multinomial`` uses). Row j's noise comes from ``generators[j]`` alone, so a
    row draws the same token whichever rows share its batch; the uniforms are drawn in one vectorised call per row
    (``exponential_`` with a generator runs element by element, ~8x slower on a CPU)."""
    vocab = probs.shape[-1]
    noise = torch.stack([torch.rand(vocab, generator=g, device=probs.device) for g in generators])
    # u in [0, 1): E = -log(u) is in (6e-8, inf]; u = 0 gives E = inf, so that token's ratio is 0, never a winner
    return (probs / noise.log_().neg_()).argmax(dim=-1)


def next_tokens(rows: list, step_logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """One token for each row (``rows[b]`` has ``spec`` and ``generator``; ``step_logits`` row b is its logits), and
    that token's logprob under the unmodified model distribution; both come back to the host in one transfer."""
    lp_all = torch.log_softmax(step_logits, dim=-1)  # the unmodified model distribution
    n = len(rows)
    choice = torch.empty(n, dtype=torch.long, device=step_logits.device)
    greedy: list[int] = []
    groups: dict[tuple[float, int, float], list[int]] = {}
    for b, row in enumerate(rows):
        spec = row.spec
        if spec.temperature == 0:
            greedy.append(b)
        else:
            top_k = spec.top_k if spec.top_k and spec.top_k > 0 else 0
            groups.setdefault((spec.temperature, top_k, spec.top_p), []).append(b)

    def part(t: torch.Tensor, block: list[int]) -> torch.Tensor:
        return t if len(block) == n else t[block]

    if greedy:
        choice[greedy] = part(lp_all, greedy).argmax(dim=-1)
    for (temperature, top_k, top_p), block in groups.items():
        plain = temperature == 1.0 and top_k == 0 and top_p >= 1.0
        probs = part(lp_all, block).exp() if plain else filtered_probs(part(step_logits, block), temperature, top_k,
                                                                       top_p)
        picked = _exponential_race(probs, [rows[b].generator for b in block])
        if len(block) == n:
            choice = picked
        else:
            choice[block] = picked
    lp = lp_all.gather(-1, choice[:, None])[:, 0]
    tokens, logprobs = torch.stack([choice.double(), lp.double()]).tolist()
    return [int(t) for t in tokens], logprobs
