"""Datum: one training example, a ModelInput plus the per-token inputs its loss needs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from .model_input import ModelInput
from .tensor import TensorData

LossFnOutput = dict[str, TensorData]

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


def _cast(key: str, tensor: TensorData, dtype: str) -> TensorData:
    if dtype == "int64":
        if any(float(x) != int(x) for x in tensor.data):
            raise ValueError(f"loss_fn_inputs[{key!r}] must hold integer token ids, got non-integral values")
        return TensorData(data=[int(x) for x in tensor.data], dtype="int64", shape=tensor.shape)
    return TensorData(data=[float(x) for x in tensor.data], dtype="float32", shape=tensor.shape)
