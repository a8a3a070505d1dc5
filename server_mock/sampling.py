"""KV-cached sampling with exact per-token logprobs.

``generate`` prefills the prompt once (batch 1), repeats the KV cache to ``num_samples`` rows, then decodes
all rows together one token per step. The returned logprobs are those of the unmodified model distribution
(float32 ``log_softmax`` of the raw logits) at the sampled tokens; temperature / top-k / top-p only shape the
distribution that is sampled from. With a seed, row ``r`` draws from its own ``torch.Generator`` seeded
from ``(seed, r)``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "SampleResult",
    "SampleSpec",
    "SampledSequence",
    "generate",
    "generate_batch",
    "row_seed",
    "teacher_forced_logprobs",
]

# Rows of (sequence length x vocab) float32 log-softmax computed at once for prompt logprobs.
_PROMPT_LOGPROB_CHUNK = 256


@dataclass
class SampleSpec:
    prompt_tokens: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0
    seed: int | None = None
    # Generation stops after emitting one of these; the stop token is included in the returned tokens.
    stop_token_ids: list[int] = field(default_factory=list)
    # Generation stops once the decoded completion contains one of these; the tokens up to and including the
    # one that completed it are returned.
    stop_strings: list[str] = field(default_factory=list)
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    # Element 0 is None; element i is the logprob of prompt token i given the tokens before it.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def row_seed(seed: int, row: int) -> int:
    """The generator seed of sample row ``row`` for request seed ``seed`` (a 63-bit int)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(row)])
    return int(ss.generate_state(1, dtype=np.uint64)[0]) & 0x7FFFFFFFFFFFFFFF


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int = 0):
    """A causal-LM forward with the KV cache (transformers 5.24 renamed ``past_key_values=``: ``cache=``)."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:  # pragma: no cover - older output classes
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


class _EvalMode:
    """Put every submodule in eval mode (no dropout, e.g. LoRA's); restore each one's mode afterwards."""

    def __init__(self, model):
        self.model = model
        self.states: list[tuple[torch.nn.Module, bool]] = []

    def __enter__(self):
        self.states = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        return self

    def __exit__(self, *exc):
        for m, training in self.states:
            m.training = training
        return False


def teacher_forced_logprobs(model, tokens: list[int]) -> list[float]:
    """Logprob of ``tokens[i]`` given ``tokens[:i]`` for i >= 1 (length ``len(tokens) - 1``), float32."""
    if len(tokens) < 2:
        return []
    device = _model_device(model)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.no_grad(), _EvalMode(model):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = lp.gather(-1, ids[0, 1:, None])[:, 0]
    return out.cpu().tolist()


def _prompt_logprobs(
    logits: torch.Tensor, prompt: torch.Tensor, want_lp: bool, topk: int
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """Prompt logprobs from prefill logits ``(P, V)`` (row i predicts token i+1)."""
    n = prompt.shape[0]
    lps: list[float | None] | None = [None] if want_lp else None
    tops: list[list[tuple[int, float]] | None] | None = [None] if topk > 0 else None
    for start in range(0, n - 1, _PROMPT_LOGPROB_CHUNK):
        end = min(start + _PROMPT_LOGPROB_CHUNK, n - 1)
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)
        if lps is not None:
            lps.extend(lp.gather(-1, prompt[start + 1 : end + 1, None])[:, 0].cpu().tolist())
        if tops is not None:
            vals, idx = lp.topk(min(topk, lp.shape[-1]), dim=-1)
            for v_row, i_row in zip(vals.cpu().tolist(), idx.cpu().tolist()):
                tops.append(list(zip(i_row, v_row)))
    return lps, tops


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Sampling probabilities from float32 logits ``(B, V)``: temperature, then top-k, then top-p."""
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


def _stop_string_hit(tokenizer, completion: list[int], stop_strings: list[str], window: int) -> bool:
    """Whether the decoded tail of the completion contains a stop string (a new one ends there)."""
    text = tokenizer.decode(
        completion[-window:], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return any(s in text for s in stop_strings)


def generate(model, spec: SampleSpec, tokenizer=None, timings: dict[str, float] | None = None) -> SampleResult:
    """Sample ``spec.num_samples`` completions of ``spec.prompt_tokens`` with a KV cache, exact logprobs.

    ``timings``, if given, receives the seconds spent in ``prefill`` and ``decode``."""
    if not spec.prompt_tokens:
        raise ValueError("prompt_tokens must not be empty")
    if spec.num_samples < 1:
        raise ValueError("num_samples must be >= 1")
    if spec.max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if spec.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0.0 < spec.top_p <= 1.0:
        raise ValueError("top_p must be in (0, 1]")
    stop_strings = [s for s in spec.stop_strings if s]
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer")

    n = spec.num_samples
    device = _model_device(model)
    greedy = spec.temperature == 0
    top_k = spec.top_k if spec.top_k and spec.top_k > 0 else 0
    plain = not greedy and spec.temperature == 1.0 and top_k == 0 and spec.top_p >= 1.0
    stop_ids = {int(t) for t in spec.stop_token_ids}
    # A newly completed stop string lies in the last (its byte length) tokens, each token being >= 1 byte; a
    # few extra tokens cover decoders that strip a leading space.
    window = max((len(s.encode("utf-8")) for s in stop_strings), default=0) + 4

    generators: list[torch.Generator] = []
    if not greedy:
        seed = spec.seed if spec.seed is not None else random.SystemRandom().getrandbits(63)
        for r in range(n):
            g = torch.Generator(device=device)
            g.manual_seed(row_seed(seed, r))
            generators.append(g)

    want_prompt = spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0
    prompt = torch.tensor(spec.prompt_tokens, dtype=torch.long, device=device)

    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    reasons: list[str] = ["length"] * n
    prompt_lps = topk_lps = None

    started = time.perf_counter()
    with torch.no_grad(), _EvalMode(model):
        logits, cache = _forward(model, prompt[None, :], None, logits_to_keep=0 if want_prompt else 1)
        prefilled = time.perf_counter()
        if want_prompt:
            prompt_lps, topk_lps = _prompt_logprobs(
                logits[0], prompt, spec.include_prompt_logprobs, spec.topk_prompt_logprobs
            )
        step_logits = logits[:, -1, :].float()  # (1, V)
        del logits

        active = list(range(n))  # sample rows still generating, in cache-batch order
        if spec.max_tokens > 0 and n > 1:
            cache.batch_repeat_interleave(n)
            step_logits = step_logits.expand(n, -1)

        for step in range(spec.max_tokens):
            lp_all = torch.log_softmax(step_logits, dim=-1)  # (B, V) unmodified model distribution
            if greedy:
                next_tok = lp_all.argmax(dim=-1)
            else:
                probs = (
                    lp_all.exp()
                    if plain
                    else _filtered_probs(step_logits, spec.temperature, top_k, spec.top_p)
                )
                next_tok = torch.cat(
                    [torch.multinomial(probs[b], 1, generator=generators[r]) for b, r in enumerate(active)]
                )
            tok_lp = lp_all.gather(-1, next_tok[:, None])[:, 0]
            tok_list = next_tok.tolist()
            lp_list = tok_lp.tolist()

            keep: list[int] = []
            for b, r in enumerate(active):
                t = tok_list[b]
                tokens[r].append(t)
                logprobs[r].append(lp_list[b])
                if t in stop_ids or (
                    stop_strings and _stop_string_hit(tokenizer, tokens[r], stop_strings, window)
                ):
                    reasons[r] = "stop"
                else:
                    keep.append(b)
            if not keep or step == spec.max_tokens - 1:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(idx)
                next_tok = next_tok[idx]
                active = [active[b] for b in keep]
            logits, cache = _forward(model, next_tok[:, None], cache, logits_to_keep=1)
            step_logits = logits[:, -1, :].float()
            del logits

    if timings is not None:
        timings["prefill"] = timings.get("prefill", 0.0) + prefilled - started
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - prefilled
    sequences = [
        SampledSequence(tokens=tokens[r], logprobs=logprobs[r], stop_reason=reasons[r]) for r in range(n)
    ]
    return SampleResult(sequences=sequences, prompt_logprobs=prompt_lps, topk_prompt_logprobs=topk_lps)


def generate_batch(model, specs: list[SampleSpec], tokenizer=None,
                   timings: dict[str, float] | None = None) -> list[SampleResult]:
    """Decode several sample requests as one batch (the async recipe's concurrent prompts).

    Each prompt is prefilled once; the caches are left-padded to a common length and merged, with an
    attention mask over the padding and per-row position ids, then every row of every request advances
    together. Row ``r`` of a request uses the same generator seed as in ``generate``, so a request gets
    the same tokens whether it ran alone or batched with others.
    """
    if len(specs) == 1 or any(s.max_tokens < 1 for s in specs):
        return [generate(model, s, tokenizer, timings) for s in specs]
    for spec in specs:
        if not spec.prompt_tokens or spec.num_samples < 1 or spec.temperature < 0 or not 0 < spec.top_p <= 1:
            raise ValueError("invalid sample spec in batch")
        if spec.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
    device = _model_device(model)
    owner: list[int] = []  # request index of each row
    sample_index: list[int] = []
    generators: list[torch.Generator | None] = []
    for i, spec in enumerate(specs):
        seed = spec.seed if spec.seed is not None else random.SystemRandom().getrandbits(63)
        for r in range(spec.num_samples):
            owner.append(i)
            sample_index.append(r)
            if spec.temperature == 0:
                generators.append(None)
            else:
                g = torch.Generator(device=device)
                g.manual_seed(row_seed(seed, r))
                generators.append(g)
    windows = [max((len(s.encode("utf-8")) for s in spec.stop_strings if s), default=0) + 4 for spec in specs]
    tokens: list[list[int]] = [[] for _ in owner]
    logprobs: list[list[float]] = [[] for _ in owner]
    reasons = ["length"] * len(owner)
    prompt_info: list[tuple] = []

    started = time.perf_counter()
    with torch.no_grad(), _EvalMode(model):
        caches, first_logits = [], []
        for spec in specs:
            want = spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0
            prompt = torch.tensor(spec.prompt_tokens, dtype=torch.long, device=device)
            logits, cache = _forward(model, prompt[None, :], None, logits_to_keep=0 if want else 1)
            prompt_info.append(_prompt_logprobs(logits[0], prompt, spec.include_prompt_logprobs,
                                                spec.topk_prompt_logprobs) if want else (None, None))
            first_logits.append(logits[:, -1, :].float())
            caches.append(cache)
            del logits
        prefilled = time.perf_counter()
        lengths = [len(s.prompt_tokens) for s in specs]
        longest = max(lengths)
        cache = caches[0]
        for layer_index, layer in enumerate(cache.layers):
            for attr in ("keys", "values"):
                parts = []
                for spec, c, n in zip(specs, caches, lengths):
                    t = getattr(c.layers[layer_index], attr)
                    if n < longest:
                        t = torch.nn.functional.pad(t, (0, 0, longest - n, 0))
                    parts.append(t.repeat_interleave(spec.num_samples, dim=0))
                setattr(layer, attr, torch.cat(parts, dim=0))
        attention = torch.zeros((len(owner), longest), dtype=torch.long, device=device)
        for row, i in enumerate(owner):
            attention[row, longest - lengths[i]:] = 1
        positions = torch.tensor([lengths[i] for i in owner], dtype=torch.long, device=device)
        step_logits = torch.cat([first_logits[i] for i in owner], dim=0)
        active = list(range(len(owner)))

        while True:
            lp_all = torch.log_softmax(step_logits, dim=-1)
            next_tok = torch.empty(len(active), dtype=torch.long, device=device)
            for i, spec in enumerate(specs):
                block = [b for b, r in enumerate(active) if owner[r] == i]
                if not block:
                    continue
                if spec.temperature == 0:
                    next_tok[block] = lp_all[block].argmax(dim=-1)
                    continue
                top_k = spec.top_k if spec.top_k and spec.top_k > 0 else 0
                plain = spec.temperature == 1.0 and top_k == 0 and spec.top_p >= 1.0
                probs = lp_all[block].exp() if plain else _filtered_probs(step_logits[block], spec.temperature,
                                                                         top_k, spec.top_p)
                for j, b in enumerate(block):
                    next_tok[b] = torch.multinomial(probs[j], 1, generator=generators[active[b]])[0]
            tok_lp = lp_all.gather(-1, next_tok[:, None])[:, 0]
            keep: list[int] = []
            for b, (t, lp) in enumerate(zip(next_tok.tolist(), tok_lp.tolist())):
                r = active[b]
                spec = specs[owner[r]]
                tokens[r].append(t)
                logprobs[r].append(lp)
                if t in spec.stop_token_ids or (spec.stop_strings and _stop_string_hit(
                        tokenizer, tokens[r], spec.stop_strings, windows[owner[r]])):
                    reasons[r] = "stop"
                elif len(tokens[r]) < spec.max_tokens:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(idx)
                attention, positions, next_tok = attention[idx], positions[idx], next_tok[idx]
                active = [active[b] for b in keep]
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
            out = model(input_ids=next_tok[:, None], cache=cache, attention_mask=attention,
                        position_ids=positions[:, None], use_cache=True, logits_to_keep=1)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            step_logits = out.logits[:, -1, :].float()
            positions = positions + 1

    if timings is not None:
        timings["prefill"] = timings.get("prefill", 0.0) + prefilled - started
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - prefilled
    results = []
    for i in range(len(specs)):
        rows = [r for r in range(len(owner)) if owner[r] == i]
        sequences = [SampledSequence(tokens=tokens[r], logprobs=logprobs[r], stop_reason=reasons[r]) for r in rows]
        results.append(SampleResult(sequences=sequences, prompt_logprobs=prompt_info[i][0],
                                    topk_prompt_logprobs=prompt_info[i][1]))
    return results
