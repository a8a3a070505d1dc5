"""KV-cached sampling with exact per-token logprobs, for every cache kind transformers uses.

One decode loop serves one request or several coalesced ones: each distinct prompt is prefilled once
(several prompts together, left-padded), the cache is expanded to one row per sample, and all rows advance one
token per step; rows that stop leave the batch. Expanding and dropping rows go through
``Cache.reorder_cache``, which every cache layer kind implements (full attention, sliding window, the
recurrent and conv states of hybrid linear-attention / short-conv models), so nothing here depends on one
cache class. Where a model cannot take that (see ``SamplingSupport``), slower paths keep the results correct.

The returned logprobs are those of the unmodified model distribution (float32 ``log_softmax`` of the raw
logits) at the sampled tokens; temperature / top-k / top-p only shape the distribution sampled from. With a
seed, row ``r`` of a request draws from its own ``torch.Generator`` seeded from ``(seed, r)``, so a request
gets the same tokens alone or coalesced with others.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from server_mock.sampling import prompt_images
from server_mock.sampling.logprobs import EvalMode, prompt_logprobs, teacher_forced_logprobs
from server_mock.sampling.token_choice import next_tokens, row_seed, stop_string_hit

__all__ = [
    "SampleResult",
    "SampleSpec",
    "SampledSequence",
    "SamplingSupport",
    "generate",
    "generate_batch",
    "row_seed",
    "teacher_forced_logprobs",
]


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
    # the prompt's images (engine.vision.ImageSpan), their tokens already in ``prompt_tokens``
    images: tuple = ()
    # never drawn (their probability is set to 0 before choosing); logprobs stay the model's distribution's
    banned_token_ids: list[int] = field(default_factory=list)


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


def _model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


@dataclass(frozen=True)
class SamplingSupport:
    """Which decoding paths a model's cache can take (``engine.support.probe_sampling`` finds out).

    ``shared_prefix``: a prompt is prefilled once and its cache expanded to the sample rows, and stopped rows
    are dropped (``Cache.reorder_cache``); otherwise every row prefills its own copy of the prompt and stopped
    rows ride along until the batch ends. ``padded_batch``: several prompts can be prefilled and decoded
    together, left-padded under an attention mask; otherwise coalesced requests run one after another.
    """

    shared_prefix: bool = True
    padded_batch: bool = True


FULL_SUPPORT = SamplingSupport()


def _forward(model, input_ids: torch.Tensor, cache, logits_to_keep: int = 0, attention_mask=None,
             position_ids=None, **extra):
    """A causal-LM forward with the cache (transformers 5.24 renamed ``past_key_values=``: ``cache=``); ``extra``:
    an image-text model's image inputs."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep,
                attention_mask=attention_mask, position_ids=position_ids, **extra)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:  # pragma: no cover - older output classes
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


def _check_spec(spec: SampleSpec, tokenizer) -> None:
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
    if any(spec.stop_strings) and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer")


@dataclass
class _Row:
    """One sample row: which request it belongs to and what it has produced so far."""

    request: int
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: str = "length"


def _make_rows(specs: list[SampleSpec], device: torch.device) -> list[_Row]:
    rows = []
    for i, spec in enumerate(specs):
        seed = spec.seed if spec.seed is not None else random.SystemRandom().getrandbits(63)
        for r in range(spec.num_samples):
            gen = None
            if spec.temperature != 0:
                gen = torch.Generator(device=device)
                gen.manual_seed(row_seed(seed, r))
            rows.append(_Row(request=i, generator=gen))
    return rows


def _left_padded(prompts: list[list[int]], device: torch.device):
    """Token ids, attention mask and position ids of prompts left-padded to one length (mask None if equal)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
    if all(len(p) == longest for p in prompts):
        return ids, None, None
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        mask[b, longest - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def _record(specs, rows, live, next_tok, tok_lp, tokenizer) -> list[int]:
    """Append each live row's token; return the positions (in ``live``) of rows that go on generating."""
    keep = []
    for b, (t, lp) in enumerate(zip(next_tok.tolist(), tok_lp.tolist())):
        row = rows[live[b]]
        spec = specs[row.request]
        row.tokens.append(t)
        row.logprobs.append(lp)
        stops = [s for s in spec.stop_strings if s]
        # a newly completed stop string lies in the last (its byte length) tokens, each token >= 1 byte; a few
        # extra tokens cover decoders that strip a leading space
        window = max((len(s.encode("utf-8")) for s in stops), default=0) + 4
        if t in spec.stop_token_ids or (stops and stop_string_hit(tokenizer, row.tokens, stops, window)):
            row.reason = "stop"
        elif len(row.tokens) < spec.max_tokens:
            keep.append(b)
    return keep


def generate(model, spec: SampleSpec, tokenizer=None, timings: dict[str, float] | None = None,
             support: SamplingSupport = FULL_SUPPORT, vision=None) -> SampleResult:
    """Sample ``spec.num_samples`` completions of ``spec.prompt_tokens`` with a KV cache, exact logprobs.

    ``timings``, if given, receives the seconds spent in ``prefill`` and ``decode``."""
    return generate_batch(model, [spec], tokenizer, timings, support, vision)[0]


def generate_batch(model, specs: list[SampleSpec], tokenizer=None, timings: dict[str, float] | None = None,
                   support: SamplingSupport = FULL_SUPPORT, vision=None) -> list[SampleResult]:
    """Decode one or several sample requests as one batch (the async recipe's concurrent prompts). ``vision``
    (``engine.vision.ImageProcessing``) is needed when a prompt holds images: the prefill takes them (the vision
    encoder runs once per prefilled prompt), the decode is text only (``prompt_images``)."""
    for spec in specs:
        _check_spec(spec, tokenizer)
        if spec.images and vision is None:
            raise ValueError("a prompt with images needs the model's image processing")
    if len(specs) > 1 and not support.padded_batch:
        return [generate_batch(model, [s], tokenizer, timings, support, vision)[0] for s in specs]
    device = _model_device(model)
    rows = _make_rows(specs, device)
    # rows of the prefill batch: one per request, or one per sample row where the cache cannot be expanded
    prefill_of_row = [row.request for row in rows]
    prefill_specs = list(specs)
    if not support.shared_prefix:
        prefill_of_row = list(range(len(rows)))
        prefill_specs = [specs[row.request] for row in rows]
    prefill_prompts = [s.prompt_tokens for s in prefill_specs]
    started = time.perf_counter()
    with torch.no_grad(), EvalMode(model):
        ids, mask, positions = _left_padded(prefill_prompts, device)
        lengths = [len(p) for p in prefill_prompts]
        want_prompt = any(s.include_prompt_logprobs or s.topk_prompt_logprobs > 0 for s in specs)
        images = prompt_images.prefill(vision, prefill_specs, ids, mask, positions, lengths)
        if images is None:
            logits, cache = _forward(model, ids, None, 0 if want_prompt else 1, mask, positions)
        else:
            logits, cache = _forward(model, ids, None, 0 if want_prompt else 1, mask, **images.prefill_inputs)
        prompt_info = _all_prompt_logprobs(specs, prefill_prompts, prefill_of_row, rows, logits, ids)
        step_logits = logits[:, -1, :].float()
        del logits
        prefilled = time.perf_counter()
        live = [r for r, row in enumerate(rows) if specs[row.request].max_tokens > 0]
        if live:
            state = _Batch(cache, step_logits, mask, positions, lengths, images)
            batch = list(range(len(rows)))  # the sample row in each cache position
            if support.shared_prefix:  # one cache row per request so far: expand to the live sample rows
                state.reorder([prefill_of_row[r] for r in live], list(range(len(prefill_prompts))))
                batch = list(live)
            _decode(model, specs, rows, state, batch, live, support, tokenizer)
    if timings is not None:
        timings["prefill"] = timings.get("prefill", 0.0) + prefilled - started
        timings["decode"] = timings.get("decode", 0.0) + time.perf_counter() - prefilled
    results = []
    for i in range(len(specs)):
        sequences = [SampledSequence(tokens=row.tokens, logprobs=row.logprobs, stop_reason=row.reason)
                     for row in rows if row.request == i]
        results.append(SampleResult(sequences=sequences, prompt_logprobs=prompt_info[i][0],
                                    topk_prompt_logprobs=prompt_info[i][1]))
    return results


def _all_prompt_logprobs(specs, prefill_prompts, prefill_of_row, rows, logits, ids):
    """Each request's prompt logprobs from the prefill logits (padding positions skipped)."""
    out = []
    for i, spec in enumerate(specs):
        if not (spec.include_prompt_logprobs or spec.topk_prompt_logprobs > 0):
            out.append((None, None))
            continue
        b = next(prefill_of_row[r] for r, row in enumerate(rows) if row.request == i)
        offset = ids.shape[1] - len(prefill_prompts[b])
        out.append(prompt_logprobs(logits[b, offset:], ids[b, offset:], spec.include_prompt_logprobs,
                                    spec.topk_prompt_logprobs))
    return out


class _Batch:
    """The decoding batch: the model's cache and, where prompts were padded or hold images, the mask and each
    row's next position (with images: what ``prompt_images.ImagePrefill`` says the text after them takes)."""

    def __init__(self, cache, step_logits, mask, positions, lengths, images=None):
        self.cache = cache
        self.step_logits = step_logits
        self.mask = mask
        self.images = images
        self.positions = None if positions is None else torch.tensor(lengths, device=step_logits.device)
        if images is not None:
            self.positions = images.next_positions

    def reorder(self, index: list[int], current: list[int]) -> None:
        """Keep cache rows ``index`` (positions in the current batch), repeating a row to expand it."""
        if index == list(range(len(current))):
            return
        idx = torch.tensor(index, dtype=torch.long, device=self.step_logits.device)
        self.cache.reorder_cache(idx)
        self.step_logits = self.step_logits[idx]
        if self.mask is not None:
            self.mask = self.mask[idx]
        if self.positions is not None:
            self.positions = self.positions[idx]

    def advance(self, model, next_tok: torch.Tensor) -> None:
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        positions = None if self.positions is None else self.positions[:, None]
        extra = {}
        if self.images is not None:
            positions, extra = self.images.step_inputs(positions, next_tok[:, None])
        logits, self.cache = _forward(model, next_tok[:, None], self.cache, 1, self.mask, positions, **extra)
        self.step_logits = logits[:, -1, :].float()
        if self.positions is not None:
            self.positions = self.positions + 1


def _decode(model, specs, rows, state: _Batch, batch: list[int], live: list[int], support, tokenizer) -> None:
    """The decode loop. ``batch``: the row in each cache position; ``live``: rows still generating."""
    while live:
        pos = {r: b for b, r in enumerate(batch)}
        live_at = [pos[r] for r in live]
        logits = state.step_logits if len(live_at) == len(batch) else state.step_logits[live_at]
        next_tok, tok_lp = next_tokens(specs, rows, live, logits)
        keep = _record(specs, rows, live, next_tok, tok_lp, tokenizer)
        if not keep:
            return
        live_tok = next_tok
        live = [live[b] for b in keep]
        if support.shared_prefix:
            state.reorder([live_at[b] for b in keep], batch)
            batch, feed = list(live), live_tok[keep]
        else:  # rows that stopped ride along, fed their last token; their outputs are never read
            feed = torch.tensor([rows[r].tokens[-1] if rows[r].tokens else 0 for r in batch], dtype=torch.long,
                                device=live_tok.device)
        state.advance(model, feed)
