"""The public types: coercion, dtypes per loss key, shapes, and the wire form of tensors."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pydantic
import pytest
import torch

import pytrio_compat as trio
from pytrio_compat.types import APIFuture, TensorData
from pytrio_compat.types.tensor import WireTensor


def test_loss_inputs_accept_numpy_lists_and_torch_with_the_dtype_each_key_needs():
    n = 4
    datum = trio.Datum(
        model_input=trio.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": np.array([2.0, 3.0, 4.0, 5.0]),  # float array of ids -> int64
            "logprobs": torch.tensor([-1, -2, -3, -4]),  # int tensor -> float32
            "advantages": [1, 0, 0, 1],  # int list -> float32
            "weights": np.ones(n, dtype=np.float64),
        },
    )
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].dtype == "int64" and inputs["target_tokens"].data == [2, 3, 4, 5]
    assert inputs["logprobs"].dtype == "float32" and inputs["logprobs"].data == [-1.0, -2.0, -3.0, -4.0]
    assert inputs["advantages"].dtype == "float32"
    assert all(v.shape == [n] for v in inputs.values())
    with pytest.raises(pydantic.ValidationError, match="integer token ids"):
        trio.Datum(model_input=trio.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [1.5]})


def test_tensor_data_rejects_what_pytrio_rejects():
    for bad in ([True, False], ["a"], (1, 2), [[1, 2], [3]]):
        with pytest.raises((pydantic.ValidationError, TypeError, ValueError)):
            TensorData.model_validate(bad)
    with pytest.raises(pydantic.ValidationError, match="holds"):
        TensorData(data=[1.0, 2.0], dtype="float32", shape=[3])
    matrix = TensorData.model_validate(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert matrix.shape == [2, 3] and matrix.dtype == "int64"
    np.testing.assert_array_equal(matrix.to_numpy(), np.arange(6).reshape(2, 3))
    assert TensorData.model_validate([]).shape == [0]


@pytest.mark.parametrize("array", [np.array([0.1, -2.5, 3e-8], np.float32), np.arange(-3, 5, dtype=np.int64),
                                   np.zeros((2, 0), np.float32)])
def test_wire_tensors_round_trip_bit_exactly(array):
    wire = WireTensor.model_validate_json(WireTensor.from_array(array).model_dump_json())
    back = wire.to_array()
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


def test_model_input_lengths_and_chunks():
    mi = trio.ModelInput.from_ints([5, 6, 7])
    assert mi.length == len(mi) == 3 and mi.to_ints() == [5, 6, 7] and not mi.is_empty
    assert trio.ModelInput.from_ints([]).is_empty
    image = trio.ImageChunk(data="aGVsbG8=", format="png", expected_tokens=4)
    assert image.data == b"hello"
    mixed = trio.ModelInput(chunks=[{"tokens": [1, 2], "type": "encoded_text"}, image])
    assert mixed.length == 6 and mixed.has_images
    with pytest.raises(ValueError):
        mixed.to_ints()


def test_params_defaults_match_pytrio():
    adam = trio.AdamParams()
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm) == (
        1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)
    sp = trio.SamplingParams()
    assert (sp.max_tokens, sp.seed, sp.stop, sp.temperature, sp.top_k, sp.top_p) == (None, None, None, 1, -1, 1)
    with pytest.raises(pydantic.ValidationError):
        trio.AdamParams(learning_rate=1e-3, momentum=0.9)


def test_api_future_result_map_and_await_from_any_loop():
    raw = concurrent.futures.Future()
    fut = APIFuture(raw)
    doubled = fut.map(lambda x: x * 2)
    assert not fut.done()
    with pytest.raises(TimeoutError):
        fut.result(timeout=0.01)
    raw.set_result(21)
    assert fut.result() == 21 and doubled.result() == 42
    assert asyncio.run(_await(doubled)) == 42
    failed = APIFuture(concurrent.futures.Future())
    failed._future.set_exception(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        failed.map(lambda x: x).result()
    assert APIFuture.completed({}).result() == {}


async def _await(fut):
    return await fut
