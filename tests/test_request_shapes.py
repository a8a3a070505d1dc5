"""Every list and map of every request body (native, Tinker and OpenAI) is bounded while it is parsed and stops
at its first bad item: read from the shapes' own pydantic core schemas, so a new unbounded list fails here."""

from __future__ import annotations

import inspect

import pytest
from pydantic import BaseModel

from pytrio_compat import wire
from server_mock.api.openai import protocol
from server_mock.api.tinker import schemas

NATIVE = [wire.CreateTrainingRun, wire.TrainingOp, wire.CreateSampler, wire.SampleRequest]
TINKER = [cls for _, cls in inspect.getmembers(schemas, inspect.isclass)
          if issubclass(cls, BaseModel) and cls.__module__ == schemas.__name__]
OPENAI = [protocol.ChatBody, protocol.CompletionBody]


def containers(schema) -> list[dict]:
    """Every list and dict validator in a pydantic core schema."""
    found = []
    if isinstance(schema, dict):
        if schema.get("type") in ("list", "dict") and ("items_schema" in schema or "values_schema" in schema
                                                      or "keys_schema" in schema):
            found.append(schema)
        for value in schema.values():
            found += containers(value)
    elif isinstance(schema, list):
        for value in schema:
            found += containers(value)
    return found


@pytest.mark.parametrize("model", NATIVE + TINKER + OPENAI, ids=lambda m: f"{m.__module__}.{m.__name__}")
def test_every_list_and_map_is_bounded_and_fails_fast(model):
    found = containers(model.__pydantic_core_schema__)
    unbounded = [f"{node['type']} without max_length" for node in found if node.get("max_length") is None]
    slow = [f"{node['type']} without fail_fast" for node in found if not node.get("fail_fast")]
    assert not unbounded and not slow, (model.__name__, unbounded + slow)


def test_the_shapes_hold_lists_at_all():
    """The walk above sees the lists (it would pass vacuously on a schema it cannot read)."""
    assert len(containers(wire.TrainingOp.__pydantic_core_schema__)) >= 4  # data, loss inputs, config, shape
    assert len(containers(schemas.Asample.__pydantic_core_schema__)) >= 4  # chunks, tokens, stop (two kinds)
    assert len(containers(protocol.CompletionBody.__pydantic_core_schema__)) >= 4  # prompt (three kinds), stop
    assert len(TINKER) >= 15
