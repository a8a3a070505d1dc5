"""A request that fails inside torch (an error, or out of memory) fails alone: the error goes to its own
future, the worker keeps serving every session, and the adapter is bit-identical to one that never saw it.

The failures are injected by the worker's test switch (PYTRIO_WORKER_FAULT_INJECTION=1, see
docs/reliability.md) during the backward pass, after part of the gradients were already accumulated.
"""

from __future__ import annotations

import re

import pytest

import pytrio_compat as trio
from pytrio_compat.errors import EventFailedError

from .reliability_helpers import KEY_A, KEY_B, datum, saved_state

ADAM = trio.AdamParams(learning_rate=1e-2, weight_decay=0.01)


def fault(error: str, after: float = 0.5) -> dict:
    return {"fault_injection": {"error": error, "after_fraction": after}}


@pytest.fixture()
def tenants(special_worker, client_cache):
    a = trio.ServiceClient(base_url=special_worker.base_url, api_key=KEY_A)
    b = trio.ServiceClient(base_url=special_worker.base_url, api_key=KEY_B)
    yield a, b
    a.close()
    b.close()


def prepared_run(client) -> trio.TrainingClient:
    """A run with one step taken (so Adam state is non-zero) and gradients pending."""
    tc = client.create_lora_training_client("tiny", rank=4, seed=21)
    tc.forward_backward([datum(0), datum(1)]).result()
    tc.optim_step(ADAM).result()
    tc.forward_backward([datum(2)]).result()
    return tc


def test_errors_inside_torch_fail_only_their_request_and_change_nothing(special_worker, tenants):
    a, b = tenants
    victim, control = prepared_run(a), prepared_run(a)
    neighbour = b.create_lora_training_client("tiny", rank=4, seed=5)  # another tenant's session
    neighbour_futures = [neighbour.forward_backward([datum(9)])]

    failures = {}
    for error, after in (("runtime_error", 0.5), ("out_of_memory", 0.3), ("runtime_error", 0.0)):
        with pytest.raises(EventFailedError) as err:
            victim.forward_backward([datum(3), datum(4, n=12)], loss_fn_config=fault(error, after)).result(timeout=60)
        failures[(error, after)] = err.value
        neighbour_futures += [neighbour.optim_step(ADAM), neighbour.forward_backward([datum(9)])]

    runtime, oom = failures[("runtime_error", 0.5)], failures[("out_of_memory", 0.3)]
    assert runtime.code == "internal_error" and "RuntimeError" in runtime.message
    assert oom.code == "out_of_memory", oom.message
    assert "out of memory while running forward_backward" in oom.message
    for err in failures.values():
        assert err.request_id and err.request_id.startswith("req-")
    accumulated = int(re.search(r"after (\d+) of (\d+) adapter gradients", runtime.message).group(1))
    assert accumulated > 0  # the failure really happened midway through accumulating gradients

    for future in neighbour_futures:  # the other session never noticed
        future.result(timeout=60)
    assert victim.forward([datum(5)]).result().metrics["token_count"] == 19.0  # the victim keeps working too

    # weights, Adam state and the pending gradients (applied by the next step) are exactly the control's
    for tc in (victim, control):
        tc.optim_step(ADAM).result()
    assert saved_state(special_worker.storage, victim) == saved_state(special_worker.storage, control)


def test_fault_injection_is_off_unless_switched_on(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    with pytest.raises(trio.PyTrioError) as err:
        tc.forward_backward([datum()], loss_fn_config=fault("runtime_error")).result()
    assert err.value.status_code == 400 and "fault_injection" in str(err.value)


def test_bad_fault_specs_are_rejected(tenants):
    tc = tenants[0].create_lora_training_client("tiny", rank=4, seed=1)
    for config, field in ((fault("segfault"), "error"), (fault("runtime_error", 1.5), "after_fraction"),
                          ({"fault_injection": {"delay_seconds": 1e9}}, "delay_seconds")):
        with pytest.raises(trio.PyTrioError) as err:
            tc.forward_backward([datum()], loss_fn_config=config).result()
        assert err.value.status_code == 400 and field in str(err.value)
    with pytest.raises(trio.PyTrioError, match="backward"):
        tc.forward([datum()], loss_fn_config=fault("runtime_error")).result()
