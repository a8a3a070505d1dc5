"""Datum: one training example, a ModelInput plus the per-token inputs its loss needs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from .model_input import ModelInput
from .tensor import TensorData

LossFnOutput = dict[str, TensorData]

# loss name: (required loss_fn_inputs, optional ones). Every input holds one value per model_input token. The policy
# losses' optional weights scale each token's loss (and its KL term: loss_fn_config kl_coef).
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "ppo": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "cispo": (("target_tokens", "logprobs", "advantages"), ("weights",)),
    "dro": (("target_tokens", "logprobs", "advantages"), ()),
}

# Keys whose dtype is fixed by the loss functions: a list of ints given for `advantages` must still
# travel as float32, and float-valued `target_tokens` (e.g. from a float numpy array) as int64.
KEY_DTYPES = {
    "target_tokens": "int64",
    "weights": "float32",
    "logprobs": "float32",
    "advantages": "float32",
    "clip_low_threshold": "float32",
    "clip_high_threshold": "float32",
}


class Datum(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]

    @field_validator("loss_fn_inputs", mode="before")
    @classmethod
    def _convert(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError("loss_fn_inputs must be a dict of name -> tensor-like")
        out = {}
        for key, item in value.items():
            tensor = item if isinstance(item, TensorData) else TensorData.model_validate(item)
            want = KEY_DTYPES.get(key)
            if want is not None and tensor.dtype != want:
                tensor = _cast(key, tensor, want)
            out[key] = tensor
        return out

    def validate_loss_inputs(self, loss_fn: str) -> None:
        """Check that this datum has what ``loss_fn`` needs: each required input, and one value per token of
        ``model_input`` in each input the loss reads. Raises ``ValueError`` naming the input and the fix."""
        name = str(loss_fn).strip().lower()
        if name not in LOSS_INPUTS:
            raise ValueError(f"Unsupported loss function type: {loss_fn} (choose one of {', '.join(LOSS_INPUTS)})")
        required, optional = LOSS_INPUTS[name]
        missing = [key for key in required if key not in self.loss_fn_inputs]
        if missing:
            raise ValueError(f"{missing[0]} is required: loss {name!r} needs loss_fn_inputs "
                             f"{', '.join(required)}; missing {', '.join(missing)}")
        length = len(self.model_input)
        for key in required + optional:
            tensor = self.loss_fn_inputs.get(key)
            if tensor is None:
                continue
            shape = list(tensor.shape) if tensor.shape is not None else [len(tensor.data)]
            if shape != [length]:
                raise ValueError(f"{key} must have shape [{length}] (one value per model_input token, for loss "
                                 f"{name!r}), got {shape}")
        if self.loss_fn_inputs["target_tokens"].dtype != "int64":
            raise ValueError("target_tokens must have dtype int64")


def _cast(key: str, tensor: TensorData, dtype: str) -> TensorData:
    if dtype == "int64":
        if any(float(x) != int(x) for x in tensor.data):
            raise ValueError(f"loss_fn_inputs[{key!r}] must hold integer token ids, got non-integral values")
        return TensorData(data=[int(x) for x in tensor.data], dtype="int64", shape=tensor.shape)
    return TensorData(data=[float(x) for x in tensor.data], dtype="float32", shape=tensor.shape)
