"""Checks on request contents, done in full before anything is queued: a rejected request never
touches an adapter. Every error names the field, and the limit when one was exceeded."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from pytrio_compat.wire import AdamParams, SampleRequest, WireImage
from server_mock.config import Limits
from server_mock.engine.host import ModelHost
from server_mock.errors import WorkerError, bad_request
from server_mock.sampling.generate import SampleSpec
from server_mock.service.image_inputs import RequestImages
from server_mock.training import losses


def validate_sample(request: SampleRequest, host: ModelHost, limits: Limits) -> SampleSpec:
    params = request.sampling_params
    prompt = token_array(request.prompt_tokens, host.vocab_size, "prompt_tokens")
    if len(prompt) == 0 and not request.prompt_images:
        raise bad_request("prompt_tokens", "prompt cannot be empty")
    check_vocab(prompt, host.vocab_size, "prompt_tokens", allow_ignore=False)
    request_images = RequestImages(host, limits)
    request_images.admit([("prompt_images", request.prompt_images)])
    prompt, spans = request_images.expand(prompt, request.prompt_images, "prompt_tokens", "prompt_images")
    if not 1 <= request.num_samples <= limits.max_num_samples:
        raise WorkerError(413 if request.num_samples > 0 else 400, "invalid_num_samples",
                          f"num_samples: must be in [1, {limits.max_num_samples}] (limit max_num_samples), "
                          f"got {describe_int(request.num_samples)}", "num_samples")
    if not 1 <= params.max_tokens <= limits.max_sample_tokens:
        raise WorkerError(413 if params.max_tokens > 0 else 400, "invalid_max_tokens",
                          f"sampling_params.max_tokens: must be in [1, {limits.max_sample_tokens}] "
                          f"(limit max_sample_tokens), got {describe_int(params.max_tokens)}",
                          "sampling_params.max_tokens")
    if len(prompt) + params.max_tokens > host.max_seq_len:
        raise WorkerError(413, "sequence_too_long",
                          f"sampling_params.max_tokens: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                          f"exceeds max_seq_len={host.max_seq_len}", "sampling_params.max_tokens")
    total = request.num_samples * (len(prompt) + params.max_tokens)
    if total > limits.max_sample_request_tokens:  # how long the request may hold the model
        raise WorkerError(413, "request_too_large",
                          f"num_samples: {request.num_samples} samples x (prompt {len(prompt)} + max_tokens "
                          f"{params.max_tokens}) = {total} tokens exceeds limit max_sample_request_tokens="
                          f"{limits.max_sample_request_tokens}; send fewer samples per request", "num_samples")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise bad_request("sampling_params.temperature", f"must be a finite number >= 0, got {params.temperature}")
    if not math.isfinite(params.top_p) or not 0 < params.top_p <= 1:
        raise bad_request("sampling_params.top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise bad_request("sampling_params.top_k", f"must be -1 (off) or >= 0, got {params.top_k}")
    if not 0 <= request.topk_prompt_logprobs <= 20:
        raise bad_request("topk_prompt_logprobs", f"must be in [0, 20], got {request.topk_prompt_logprobs}")
    stop_strings = check_stop_strings(params.stop, limits)
    if params.stop_token_ids is not None:
        if len(params.stop_token_ids) > limits.max_stop_token_ids:
            raise WorkerError(413, "too_many_stop_token_ids",
                              f"sampling_params.stop_token_ids: {len(params.stop_token_ids)} ids exceeds limit "
                              f"max_stop_token_ids={limits.max_stop_token_ids}", "sampling_params.stop_token_ids")
        check_vocab(token_array(params.stop_token_ids, host.vocab_size, "sampling_params.stop_token_ids"),
                    host.vocab_size, "sampling_params.stop_token_ids", allow_ignore=False)
        stop_ids = list(params.stop_token_ids)
    else:
        stop_ids = host.stop_token_ids()
    return SampleSpec(
        prompt_tokens=prompt.tolist(), num_samples=request.num_samples, max_tokens=params.max_tokens,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        stop_token_ids=stop_ids, stop_strings=stop_strings,
        include_prompt_logprobs=request.include_prompt_logprobs,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        images=spans,
        # a sampled image placeholder would stand for an image that is not there (and the datum made from the
        # completion could not be trained on): never drawn; logprobs stay those of the model's distribution
        banned_token_ids=[host.vision.image_token_id] if spans else [],
    )


def check_stop_strings(stop: list[str] | None, limits: Limits) -> list[str]:
    """Stop strings are matched against the decoded tail at every step: their count and length are bounded."""
    if not stop:
        return []
    field = "sampling_params.stop"
    if len(stop) > limits.max_stop_strings:
        raise WorkerError(413, "too_many_stop_strings", f"{field}: {len(stop)} strings exceeds limit "
                                                        f"max_stop_strings={limits.max_stop_strings}", field)
    for i, text in enumerate(stop):
        if not text:
            raise bad_request(field, f"stop strings must be non-empty (item {i} is empty)")
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limits.max_stop_string_bytes:
            raise WorkerError(413, "stop_string_too_long",
                              f"{field}[{i}]: {size} bytes exceeds limit max_stop_string_bytes="
                              f"{limits.max_stop_string_bytes}", field)
    return list(stop)


def check_datum_count(count: int, limits: Limits, field: str) -> None:
    """413 naming ``field`` when a request carries more datums than ``--max-datums-per-request``."""
    if count > limits.max_datums_per_request:
        raise WorkerError(413, "too_many_datums", f"{field}: {count} datums exceeds limit max_datums_per_request="
                                                  f"{limits.max_datums_per_request} (--max-datums-per-request); "
                                                  "split the batch into requests of at most that many", field)


def validate_rows(loss_fn: str, data: Sequence[Mapping[str, np.ndarray]], host: ModelHost,
                  limits: Limits, images: Sequence[Sequence[WireImage] | None] | None = None,
                  ) -> list[dict[str, np.ndarray]]:
    """A forward op's datums, checked: each a mapping of ``tokens`` and its loss inputs by name (a front end may
    pass mappings that decode an array when it is read, raising a 4xx naming the field; an input the loss does
    not use is never read). ``images[i]``: datum i's image chunks, put into its tokens (``image_inputs``); the
    loss inputs then cover the expanded sequence. Returns plain dicts of the arrays the loss reads, plus
    ``"images"`` (a tuple of ``ImageSpan``) on a datum with images."""
    if not data:
        raise bad_request("data", "training data cannot be empty")
    check_datum_count(len(data), limits, "data")
    request_images = RequestImages(host, limits)
    if images is not None:
        request_images.admit([(f"data[{i}].images", group) for i, group in enumerate(images[:len(data)])])
    required = losses.REQUIRED_INPUTS[loss_fn]
    optional = losses.OPTIONAL_INPUTS[loss_fn]
    out = []
    total = 0
    cells = 0
    for i, datum in enumerate(data):
        where = f"data[{i}]"
        tokens = datum["tokens"]
        datum_images = images[i] if images is not None and i < len(images) else None
        if tokens.dtype != np.int64 or tokens.ndim != 1 or (len(tokens) == 0 and not datum_images):
            raise bad_request(f"{where}.tokens", "must be a non-empty 1-D int64 tensor")
        spans = ()
        if datum_images:
            check_vocab(tokens, host.vocab_size, f"{where}.tokens", allow_ignore=False)
            tokens, spans = request_images.expand(tokens, datum_images, f"{where}.tokens", f"{where}.images")
        n = len(tokens)
        total += n
        if n > host.max_seq_len:
            raise WorkerError(413, "sequence_too_long", f"{where}.tokens: {n} tokens exceeds limit "
                                                        f"max_seq_len={host.max_seq_len}", f"{where}.tokens")
        check_vocab(tokens, host.vocab_size, f"{where}.tokens", allow_ignore=False)
        row = {"tokens": tokens}
        if spans:
            row["images"] = spans
        for key in required + optional:
            if key not in datum:
                if key in losses.RECORDED_INPUTS:
                    raise bad_request(f"{where}.loss_fn_inputs.{key}", RECORDED_HINT)
                if key in required:
                    raise bad_request(f"{where}.loss_fn_inputs.{key}",
                                      f"required by loss {loss_fn!r} (needs {', '.join(required)})")
                continue
            soft = key in losses.SOFT_TARGET_INPUTS.get(loss_fn, ())
            row[key] = _loss_input(datum[key], key, n, f"{where}.loss_fn_inputs.{key}", host,
                                   limits.max_target_k if soft else 0)
        if any(row[key].ndim == 2 for key in losses.SOFT_TARGET_INPUTS.get(loss_fn, ()) if key in row):
            cells += _check_soft_targets(row, where)
        out.append(row)
    if total > limits.max_tokens_per_request:
        raise WorkerError(413, "request_too_large", f"data: {total} tokens exceeds limit "
                                                    f"max_tokens_per_request={limits.max_tokens_per_request}", "data")
    if cells > limits.max_target_cells:
        raise WorkerError(413, "request_too_large", f"data: {cells} soft-target cells (N x K, all datums) exceeds "
                                                    f"limit max_target_cells={limits.max_target_cells}", "data")
    return out


RECORDED_HINT = ("filled in by the worker from what it recorded at sampling time, never sent: sample with "
                 "record_stability_info=True and name each datum's sampled sequences in its provenance spans "
                 "(Datum.with_provenance; the Tinker protocol, /api/v1)")


def _check_soft_targets(row: dict[str, np.ndarray], where: str) -> int:
    """Soft targets [N, K] and their weights come together, of one shape; returns N x K."""
    targets, weights = row["target_tokens"], row.get("weights")
    if targets.ndim == 1:
        raise bad_request(f"{where}.loss_fn_inputs.weights", f"weights of shape {list(weights.shape)} need "
                                                              "target_tokens of the same shape (soft targets)")
    if weights is None or weights.shape != targets.shape:
        got = "none" if weights is None else list(weights.shape)
        raise bad_request(f"{where}.loss_fn_inputs.weights", f"soft targets of shape {list(targets.shape)} need "
                                                              f"weights of the same shape, got {got}")
    return targets.size


def _loss_input(value: np.ndarray, key: str, n: int, where: str, host: ModelHost, max_k: int = 0) -> np.ndarray:
    """One loss input, checked: shape [n] (or [n, K], 1 <= K <= ``max_k``, where K values per position are
    allowed), dtype, vocabulary and finiteness."""
    if max_k and value.ndim == 2 and value.shape[0] == n:
        if not 1 <= value.shape[1] <= max_k:
            raise WorkerError(413 if value.shape[1] > max_k else 400, "invalid_soft_targets",
                              f"{where}: K = {value.shape[1]} values per position must be in [1, {max_k}] "
                              f"(limit max_target_k)", where)
    elif value.shape != (n,):
        two_d = f" or [{n}, K]" if max_k else ""
        raise bad_request(where, f"must have shape [{n}]{two_d} (the length of the tokens), got {list(value.shape)}")
    if key == "target_tokens":
        if value.dtype != np.int64:
            raise bad_request(where, "must be int64 token ids")
        check_vocab(value, host.vocab_size, where, allow_ignore=True)
        return value
    value = value.astype(np.float32)
    if not np.isfinite(value).all():
        bad = int(np.flatnonzero(~np.isfinite(value.reshape(-1)))[0])
        cell = np.unravel_index(bad, value.shape)
        at = f"position {cell[0]}" if value.ndim == 1 else f"cell {list(map(int, cell))}"
        raise bad_request(where, f"must be finite; {at} is {value.reshape(-1)[bad]}")
    return value


def describe_int(value: int) -> str:
    """An integer for a message: its digits, or its size when it has too many to print."""
    return str(value) if -(2**64) < value < 2**64 else f"{'-' if value < 0 else ''}(a {value.bit_length()}-bit integer)"


def token_array(ids: Sequence[int], vocab_size: int, field_name: str) -> np.ndarray:
    """Token ids as int64; an id that does not even fit in 64 bits is refused like any id outside the vocabulary."""
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:
        pos = next(i for i, t in enumerate(ids) if not -(2**63) <= t < 2**63)
        raise bad_request(field_name, f"token id {describe_int(ids[pos])} at position {pos} is outside the "
                                      f"vocabulary [0, {vocab_size})", code="token_id_out_of_range") from None


def check_vocab(ids: np.ndarray, vocab_size: int, field_name: str, allow_ignore: bool) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if allow_ignore:
        bad &= ids != losses.IGNORE_INDEX
    if bad.any():
        flat = int(np.flatnonzero(bad.reshape(-1))[0])
        cell = np.unravel_index(flat, ids.shape)
        at = f"position {int(cell[0])}" if ids.ndim == 1 else f"cell {[int(c) for c in cell]}"
        hint = " (use -100 to ignore a position)" if allow_ignore else ""
        raise bad_request(field_name, f"token id {int(ids.reshape(-1)[flat])} at {at} is outside the vocabulary "
                                      f"[0, {vocab_size}){hint}", code="token_id_out_of_range")


def check_adam(adam: AdamParams) -> AdamParams:
    checks = [
        ("learning_rate", adam.learning_rate >= 0, ">= 0"),
        ("beta1", 0 <= adam.beta1 < 1, "in [0, 1)"),
        ("beta2", 0 <= adam.beta2 < 1, "in [0, 1)"),
        ("eps", adam.eps > 0, "> 0"),
        ("weight_decay", adam.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", adam.grad_clip_norm >= 0, ">= 0 (0 disables clipping)"),
    ]
    for name, ok, want in checks:
        value = getattr(adam, name)
        if not math.isfinite(value) or not ok:
            raise bad_request(f"adam_params.{name}", f"must be finite and {want}, got {value}")
    return adam
