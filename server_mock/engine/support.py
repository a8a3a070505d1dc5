"""What the worker can do with a loaded model: refuse what it cannot serve, probe the decoding paths, and
compute the output head in float32.

Checked once when a model loads, on a few random tokens (milliseconds): that the model is a causal LM whose
KV-cached decoding reproduces a full forward pass (else the sampler's logprobs could not match the trainer's),
that LoRA has Linear layers to adapt, and which sampling paths its cache takes (``SamplingSupport``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from server_mock.errors import WorkerError
from server_mock.sampling import cache_rows
from server_mock.sampling.generate import SamplingSupport

logger = logging.getLogger("server_mock")

__all__ = ["Float32Head", "probe_sampling", "refuse", "use_float32_head"]

_PROBE_PROMPTS = (11, 6)  # two prompt lengths: the shorter is left-padded when both are prefilled together
_PROBE_STEPS = 3
_PROBE_PREFIX = 7  # a shared prefix, then the two prompts as suffixes of different lengths (a hole in the mask)


def refuse(model_type: str, missing: str) -> WorkerError:
    return WorkerError(422, "model_not_supported",
                       f"model type {model_type!r} cannot be served: {missing}", "base_model")


class Float32Head(nn.Linear):
    """The output projection computed in float32 whatever the model's dtype or an autocast region.

    In bfloat16 the logits' rounding alone moves logprobs by ~1e-2; doing the last matmul in float32 in both
    the sampler and the trainer removes that part of their disagreement. In a float32 model it changes nothing.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return nn.functional.linear(x.float(), self.weight.float(), bias)


def use_float32_head(model: nn.Module) -> bool:
    """Make the model's output head a ``Float32Head`` (same parameters, tied or not); False if it has none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:  # noqa: E721 - exactly a plain Linear, nothing we do not know
        return False
    head.__class__ = Float32Head
    return True


def _forward(model, ids, cache=None, mask=None, positions=None):
    out = model(input_ids=ids, cache=cache, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.logits.float(), getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def probe_sampling(model: nn.Module, vocab_size: int) -> SamplingSupport:
    """Which decoding paths reproduce a full forward pass on this model; raises if cached decoding fails."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    low = min(3, vocab_size - 1)
    long_p, short_p = (torch.randint(low, vocab_size, (1, n), generator=gen).to(device) for n in _PROBE_PROMPTS)
    follow = torch.randint(low, vocab_size, (1, _PROBE_STEPS), generator=gen).to(device)
    with torch.no_grad():
        try:
            ref = model(input_ids=torch.cat([short_p, follow], 1), use_cache=False).logits.float()[0]
        except Exception as exc:  # noqa: BLE001 - any failure means the model cannot be served
            raise refuse(model_type, f"a forward pass failed ({type(exc).__name__}: {exc})") from exc
        ref = ref[short_p.shape[1] - 1:]
        ref_long = model(input_ids=torch.cat([long_p, follow], 1), use_cache=False).logits.float()[0]
        ref_long = ref_long[long_p.shape[1] - 1:]
        tol = (1e-3 if dtype == torch.float32 else 5e-2) * max(1.0, float(ref.abs().max()))
        try:
            solo = _decode_solo(model, short_p, follow)
        except Exception as exc:  # noqa: BLE001
            raise refuse(model_type, f"KV-cached decoding failed ({type(exc).__name__}: {exc})") from exc
        if float((solo - ref).abs().max()) > tol:
            raise refuse(model_type, "KV-cached decoding does not reproduce a full forward pass, so sampled "
                                     "logprobs could not match the trainer's")
        shared = _agrees(lambda: _decode_expanded(model, short_p, follow), ref, tol)
        padded = _agrees(lambda: _decode_padded(model, long_p, short_p, follow), ref, tol)
        refs = {id(short_p): ref, id(long_p): ref_long}
        joined = padded and all(
            _agrees(lambda a=a, b=b: _decode_joined(model, a, b, follow, refs), torch.zeros(()), tol)
            for a, b in ((short_p, long_p), (long_p, short_p)))
        reused = shared and joined and _agrees(lambda: _decode_on_prefix(model, vocab_size, follow, tol),
                                               torch.zeros(()), tol)
    support = SamplingSupport(shared_prefix=shared, padded_batch=padded, join_running=joined, prefix_reuse=reused)
    if not shared:
        logger.warning("model type %s: its cache cannot be expanded or reordered; every sample row prefills its "
                       "own copy of the prompt and stopped rows stay in the batch (correct, slower)", model_type)
    if not padded:
        logger.warning("model type %s: prompts cannot be left-padded into one batch; concurrent sample requests "
                       "are decoded one after another (correct, slower)", model_type)
    elif not joined:
        logger.warning("model type %s: its cache cannot take new rows while decoding; a sample request that arrives "
                       "during a batch's decode waits for that batch to end (correct, slower)", model_type)
    if not reused:
        logger.info("model type %s: prompts are prefilled whole (a shared prefix's cache is not reused across "
                    "requests: its cache is not full attention only, or a split prefill differs)", model_type)
    return support


def _agrees(run, ref: torch.Tensor, tol: float) -> bool:
    try:
        out = run()
    except Exception as exc:  # noqa: BLE001 - a path that raises is a path not taken
        logger.debug("sampling probe path failed: %r", exc)
        return False
    return out is not None and float((out - ref).abs().max()) <= tol


def _decode_solo(model, prompt, follow):
    logits, cache = _forward(model, prompt)
    rows = [logits[0, -1]]
    for t in range(follow.shape[1]):
        logits, cache = _forward(model, follow[:, t:t + 1], cache)
        rows.append(logits[0, -1])
    return torch.stack(rows)


def _decode_expanded(model, prompt, follow):
    """Prefill once, expand to three rows, drop two of them midway: every row must match the reference."""
    logits, cache = _forward(model, prompt)
    cache.reorder_cache(torch.tensor([0, 0, 0], device=prompt.device))
    rows = [logits[0, -1]]
    for t in range(follow.shape[1]):
        if t == 1:
            cache.reorder_cache(torch.tensor([2], device=prompt.device))
        ids = follow[:, t:t + 1].expand(3 if t == 0 else 1, 1)
        logits, cache = _forward(model, ids, cache)
        rows.append(logits[-1, -1])
    return torch.stack(rows)


def _decode_joined(model, first, second, follow, refs):
    """Prefill ``first`` and decode one token; then prefill ``second``, stack its row under (columns
    right-aligned, as ``DecodeBatch`` admits a request) and decode both. Returns the largest gap of either row's
    logits to its full-forward reference (``refs``), so ``_agrees`` compares it with zero."""
    logits, cache = _forward(model, first)
    rows_a = [logits[0, -1]]
    logits, cache = _forward(model, follow[:, :1], cache)
    rows_a.append(logits[0, -1])
    len_a, len_b = first.shape[1] + 1, second.shape[1]
    logits_b, cache_b = _forward(model, second)
    rows_b = [logits_b[0, -1]]
    columns = max(len_a, len_b)
    if not cache_rows.stackable(cache):
        return None
    cache_rows.stack(cache, cache_b, columns, 0)
    mask = torch.zeros((2, columns), dtype=torch.long, device=first.device)
    mask[0, columns - len_a:], mask[1, columns - len_b:] = 1, 1
    positions = torch.tensor([[len_a], [len_b]], device=first.device)
    for t in range(follow.shape[1] - 1):  # row a is one token ahead of row b
        mask = torch.cat([mask, mask.new_ones((2, 1))], dim=1)
        ids = torch.stack([follow[0, t + 1:t + 2], follow[0, t:t + 1]])
        logits, cache = _forward(model, ids, cache, mask, positions)
        rows_a.append(logits[0, -1])
        rows_b.append(logits[1, -1])
        positions = positions + 1
    gap_a = (torch.stack(rows_a) - refs[id(first)]).abs().max()
    gap_b = (torch.stack(rows_b) - refs[id(second)][:len(rows_b)]).abs().max()
    return torch.maximum(gap_a, gap_b)


def _decode_padded(model, long_p, short_p, follow):
    """Prefill a long and a short prompt together (the short one left-padded), decode both; the short row."""
    n_long, n_short = long_p.shape[1], short_p.shape[1]
    ids = torch.zeros((2, n_long), dtype=torch.long, device=long_p.device)
    ids[0], ids[1, n_long - n_short:] = long_p[0], short_p[0]
    mask = torch.zeros_like(ids)
    mask[0], mask[1, n_long - n_short:] = 1, 1
    logits, cache = _forward(model, ids, None, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    rows = [logits[1, -1]]
    positions = torch.tensor([[n_long], [n_short]], device=long_p.device)
    for t in range(follow.shape[1]):
        mask = torch.cat([mask, mask.new_ones((2, 1))], dim=1)
        logits, cache = _forward(model, follow[:, t:t + 1].expand(2, 1), cache, mask, positions)
        rows.append(logits[1, -1])
        positions = positions + 1
    return torch.stack(rows)


def _decode_on_prefix(model, vocab_size: int, follow, tol: float):
    """Prefill a prefix once as one row, copy its cache to two rows and prefill two suffixes of different lengths
    against it (the shorter left-padded after the prefix, the padding hidden by the mask), then decode both, as
    ``DecodeBatch`` does with a stored prefix; the largest gap of either row's logits to a full forward of its whole
    prompt (None when the cache is not full attention only)."""
    device = follow.device
    gen = torch.Generator().manual_seed(1)
    low = min(3, vocab_size - 1)
    prefix = torch.randint(low, vocab_size, (1, _PROBE_PREFIX), generator=gen).to(device)
    suffixes = [torch.randint(low, vocab_size, (1, n), generator=gen).to(device) for n in (4, 2)]
    refs = []
    for suffix in suffixes:
        whole = torch.cat([prefix, suffix, follow], 1)
        logits = model(input_ids=whole, use_cache=False).logits.float()[0]
        refs.append(logits[_PROBE_PREFIX + suffix.shape[1] - 1:])
    _, cache = _forward(model, prefix)
    if not cache_rows.full_attention_only(cache):
        return None
    rows = cache_rows.repeated(cache, 2)
    longest = max(s.shape[1] for s in suffixes)
    ids = torch.zeros((2, longest), dtype=torch.long, device=device)
    mask = torch.ones((2, _PROBE_PREFIX + longest), dtype=torch.long, device=device)
    positions = torch.zeros((2, longest), dtype=torch.long, device=device)
    for b, suffix in enumerate(suffixes):
        n = suffix.shape[1]
        ids[b, longest - n:] = suffix[0]
        mask[b, _PROBE_PREFIX:_PROBE_PREFIX + longest - n] = 0
        positions[b] = _PROBE_PREFIX
        positions[b, longest - n:] = torch.arange(_PROBE_PREFIX, _PROBE_PREFIX + n, device=device)
    logits, rows = _forward(model, ids, rows, mask, positions)
    got = [[logits[0, -1]], [logits[1, -1]]]
    nxt = torch.tensor([[_PROBE_PREFIX + s.shape[1]] for s in suffixes], device=device)
    for t in range(follow.shape[1]):
        mask = torch.cat([mask, mask.new_ones((2, 1))], dim=1)
        logits, rows = _forward(model, follow[:, t:t + 1].expand(2, 1), rows, mask, nxt)
        got[0].append(logits[0, -1])
        got[1].append(logits[1, -1])
        nxt = nxt + 1
    # the stored prefix must be untouched by its copies' decoding: a second copy gives the first row's logits again
    again, _ = _forward(model, ids[:1, longest - suffixes[0].shape[1]:], cache_rows.repeated(cache, 1))
    gaps = [(torch.stack(g) - ref).abs().max() for g, ref in zip(got, refs)]
    gaps.append((again[0, -1] - refs[0][0]).abs().max())
    return torch.stack(gaps).max()
