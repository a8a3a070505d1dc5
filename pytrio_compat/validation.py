"""Client-side checks of a training batch, run before anything is sent.

The order and the exception types follow PyTRIO (plain ValueError for per-key problems, ValidationError
with a code for the rest), so scripts that catch either keep working. Every message names the field.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ValidationError
from .types import Datum
from .types.datum import LOSS_INPUTS
from .types.tensor import WireTensor
from .wire import WireDatum, WireImage

IGNORE_INDEX = -100


def normalize_loss_name(loss_fn: str) -> str:
    name = str(loss_fn).strip().lower()
    if name not in LOSS_INPUTS:
        raise ValueError(f"Unsupported loss function type: {loss_fn} (choose one of {', '.join(LOSS_INPUTS)})")
    return name


def validate_batch(
    data: list[Datum], loss_fn: str, vocab_size: int, max_seq_len: int | None = None
) -> tuple[str, list[WireDatum]]:
    """Check a batch and convert it to its wire form. Raises before any request is made."""
    if not data:
        raise ValidationError("training data cannot be empty", code="validation.empty_training_data",
                              hint="pass at least one Datum")
    name = normalize_loss_name(loss_fn)
    required, optional = LOSS_INPUTS[name]
    wire = []
    for index, datum in enumerate(data):
        if not isinstance(datum, Datum):
            datum = Datum.model_validate(datum)
        for key in required:
            if key not in datum.loss_fn_inputs:
                raise ValueError(f"{key} is required (sample {index}, loss {name})")
        tokens, images = _images_counted(datum, index)
        seq_len = len(tokens) + sum(chunk.expected_tokens for _, chunk in images)
        if seq_len < 1:
            raise ValidationError(f"sample {index} has an empty model_input", code="validation.empty_training_sample",
                                  details={"sample_index": index})
        if max_seq_len is not None and seq_len > max_seq_len:
            raise ValidationError(
                f"sample {index} has {seq_len} tokens, more than the worker's max_seq_len {max_seq_len}",
                code="validation.training_sample_too_long", details={"sample_index": index},
                hint="truncate the sequence or start the worker with a larger --max-seq-len",
            )
        _check_ids("input_ids", tokens, vocab_size, index, allow_ignore=False)
        inputs: dict[str, WireTensor] = {}
        for key in required + optional:
            if key not in datum.loss_fn_inputs:
                continue
            tensor = datum.loss_fn_inputs[key]
            if list(tensor.shape or []) != [seq_len]:
                raise ValueError(f"{key} must have shape [{seq_len}] (the model_input length), got {tensor.shape}"
                                 f" for sample {index}")
            if key == "target_tokens":
                if tensor.dtype != "int64":
                    raise ValueError("target_tokens must have dtype int64")
                _check_ids("target_tokens", tensor.data, vocab_size, index, allow_ignore=True)
            else:
                for pos, value in enumerate(tensor.data):
                    if not math.isfinite(value):
                        raise ValueError(f"{key}[{pos}] must be finite for sample {index}, got {value}")
            inputs[key] = WireTensor.from_tensor_data(tensor)
        wire.append(WireDatum(tokens=WireTensor.from_array(np.asarray(tokens, dtype=np.int64)), loss_fn_inputs=inputs,
                              images=[WireImage(position=at, chunk=chunk) for at, chunk in images] or None))
    return name, wire


def _images_counted(datum: Datum, index: int):
    """The datum's text tokens and images, each image with its ``expected_tokens``: one image left without it gets
    what the loss inputs' length leaves for it (as PyTRIO infers it); more than one cannot be inferred."""
    tokens, images = datum.model_input.text_and_images()
    missing = [k for k, (_, chunk) in enumerate(images) if chunk.expected_tokens is None]
    if not missing:
        return tokens, images
    target = datum.loss_fn_inputs.get("target_tokens")
    known = len(tokens) + sum(chunk.expected_tokens or 0 for _, chunk in images)
    left = (list(target.shape or [])[:1] or [0])[0] - known if target is not None else 0
    if len(missing) > 1 or left < 1:
        raise ValidationError(f"sample {index}: set expected_tokens on its image chunks (it can be inferred from "
                              "the loss inputs' length for one image only)",
                              code="validation.image_expected_tokens_missing", details={"sample_index": index},
                              hint="count with the model's image processor (the rendered prompt's count)")
    at, chunk = images[missing[0]]
    images[missing[0]] = (at, chunk.model_copy(update={"expected_tokens": left}))
    return tokens, images


def _check_ids(field: str, ids: list[int], vocab_size: int, sample: int, allow_ignore: bool) -> None:
    for pos, tok in enumerate(ids):
        if allow_ignore and tok == IGNORE_INDEX:
            continue
        if not 0 <= tok < vocab_size:
            raise ValidationError(
                f"{field}[{pos}] = {tok} in sample {sample} is outside the vocabulary [0, {vocab_size})",
                code="validation.token_id_out_of_range",
                details={"field": field, "sample_index": sample, "token_index": pos, "token_id": tok,
                         "vocab_size": vocab_size},
                hint="tokenize with this model's tokenizer (training_client.get_tokenizer())"
                + ("; use -100 to ignore a position" if allow_ignore else ""),
            )


CHECKPOINT_NAME = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_-])?$"


def checkpoint_name(name: str) -> str:
    """PyTRIO's checkpoint-name rules: spaces become '-', long names are shortened with a hash."""
    import hashlib
    import re

    if not isinstance(name, str):
        raise ValidationError("checkpoint name must be a string", code="validation.invalid_checkpoint_name")
    name = name.replace(" ", "-")
    if len(name) > 200:
        name = name[:180] + hashlib.sha256(name.encode()).hexdigest()[:20]
    if not re.fullmatch(CHECKPOINT_NAME, name):
        raise ValidationError(
            f"invalid checkpoint name {name!r}", code="validation.invalid_checkpoint_name",
            hint="use letters, digits, '.', '_' and '-', starting with a letter or digit and not ending with '.'",
        )
    return name
