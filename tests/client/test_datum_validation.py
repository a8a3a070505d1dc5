"""Datum.validate_loss_inputs: each loss's required inputs, and one value per model_input token."""

from __future__ import annotations

import pytest

import pytrio_compat as trio
from pytrio_compat.types.datum import LOSS_INPUTS

N = 5
FULL = {"target_tokens": [1, 2, 3, 4, 5], "weights": [1.0] * N, "logprobs": [-0.5] * N, "advantages": [0.1] * N}


def _datum(**inputs) -> trio.Datum:
    return trio.Datum(model_input=trio.ModelInput.from_ints([7] * N), loss_fn_inputs=inputs)


@pytest.mark.parametrize("loss", sorted(LOSS_INPUTS))
def test_complete_inputs_pass(loss):
    required, optional = LOSS_INPUTS[loss]
    assert _datum(**{k: FULL[k] for k in required}).validate_loss_inputs(loss) is None
    assert _datum(**{k: FULL[k] for k in required + optional}).validate_loss_inputs(f" {loss.upper()} ") is None


@pytest.mark.parametrize("loss, missing", [(loss, key) for loss, (req, _) in LOSS_INPUTS.items() for key in req])
def test_each_missing_input_is_named(loss, missing):
    required, _ = LOSS_INPUTS[loss]
    datum = _datum(**{k: FULL[k] for k in required if k != missing})
    with pytest.raises(ValueError, match=f"^{missing} is required: loss '{loss}'"):
        datum.validate_loss_inputs(loss)


@pytest.mark.parametrize("loss, key", [(loss, key) for loss, (req, opt) in LOSS_INPUTS.items() for key in req + opt])
@pytest.mark.parametrize("length", [N - 1, N + 2])
def test_each_length_mismatch_is_named(loss, key, length):
    required, _ = LOSS_INPUTS[loss]
    inputs = {k: FULL[k] for k in set(required) | {key}}
    inputs[key] = (list(range(length)) if key == "target_tokens" else [0.5] * length)
    with pytest.raises(ValueError, match=rf"^{key} must have shape \[{N}\].*got \[{length}\]"):
        _datum(**inputs).validate_loss_inputs(loss)


def test_inputs_the_loss_does_not_read_are_not_checked():
    datum = _datum(target_tokens=FULL["target_tokens"], advantages=[0.0] * (N + 3))
    datum.validate_loss_inputs("cross_entropy")  # cross_entropy never reads advantages
    with pytest.raises(ValueError, match="advantages must have shape"):
        _datum(target_tokens=FULL["target_tokens"], logprobs=FULL["logprobs"],
               advantages=[0.0] * (N + 3)).validate_loss_inputs("ppo")


def test_unknown_loss_and_two_dimensional_targets():
    with pytest.raises(ValueError, match="Unsupported loss function type: gspo"):
        _datum(**FULL).validate_loss_inputs("gspo")
    two_d = trio.TensorData(data=list(range(2 * N)), dtype="int64", shape=[N, 2])
    with pytest.raises(ValueError, match=rf"target_tokens must have shape \[{N}\].*got \[{N}, 2\]"):
        _datum(target_tokens=two_d).validate_loss_inputs("cross_entropy")
