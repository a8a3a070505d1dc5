"""The worker's AdamW against ``torch.optim.AdamW`` itself, when some parameters have no gradient in some
steps (torch skips them: no decay, no moment update, no step). Also: the per-parameter step counts survive
a save/load, and a checkpoint written before they existed still loads."""

from __future__ import annotations

import httpx
import pytest
import torch

import pytrio_compat as trio
from pytrio_compat.types import AdamParams
from pytrio_compat.wire import LoraSpec
from server_mock.engine.local_host import LocalModelHost

from .reliability_helpers import datum

ADAM = AdamParams(learning_rate=3e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def host(tiny_model_dir):
    return LocalModelHost("tiny", str(tiny_model_dir), "cpu", torch.float32)


def _grads(adapter, step: int) -> dict[str, torch.Tensor | None]:
    """Seeded gradients; every third parameter (shifting each step) and all of step 2 get none."""
    gen = torch.Generator().manual_seed(100 + step)
    out = {}
    for i, (name, param) in enumerate(adapter.params.items()):
        skip = step == 2 or (i + step) % 3 == 0
        out[name] = None if skip else torch.randn(param.shape, generator=gen)
    return out


def _reference(adapter) -> tuple[dict[str, torch.nn.Parameter], torch.optim.AdamW]:
    params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in adapter.params.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps, weight_decay=ADAM.weight_decay, foreach=False)
    return params, opt


def _step_both(host, adapter, params, opt, step: int) -> None:
    for name, grad in _grads(adapter, step).items():
        adapter.params[name].grad = None if grad is None else grad.clone()
        params[name].grad = None if grad is None else grad.clone()
    host.optim_step(adapter, ADAM)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _max_diff(adapter, params) -> float:
    return max(float((adapter.params[n].detach() - params[n].detach()).abs().max()) for n in params)


def test_adamw_skips_parameters_without_gradients_like_torch(host):
    adapter = host.create_adapter("run-adamw-a", LoraSpec(rank=4, seed=3))
    params, opt = _reference(adapter)
    moved_before = None
    for step in range(1, 7):
        if step == 2:
            moved_before = {n: p.detach().clone() for n, p in adapter.params.items()}
        _step_both(host, adapter, params, opt, step)
        if step == 2:  # no gradient anywhere: torch changes nothing, and neither may the worker
            assert all(torch.equal(moved_before[n], p.detach()) for n, p in adapter.params.items())
        assert _max_diff(adapter, params) < 1e-6, step
    for name, param in params.items():  # torch's own per-parameter step counts
        expected = int(opt.state[param]["step"]) if param in opt.state else 0
        assert adapter.param_steps.get(name, 0) == expected, name
    assert len({adapter.param_steps[n] for n in adapter.param_steps}) > 1  # the counts really differ


def test_step_counts_survive_save_and_load_and_old_checkpoints_load(host):
    adapter = host.create_adapter("run-adamw-b", LoraSpec(rank=4, seed=4))
    params, opt = _reference(adapter)
    for step in (1, 3, 4):
        _step_both(host, adapter, params, opt, step)
    state = {k: v.clone() for k, v in host.optimizer_state(adapter).items()}
    weights = host.adapter_weights(adapter)
    resumed = host.create_adapter("run-adamw-c", LoraSpec(rank=4, seed=5))
    host.load_adapter_weights(resumed, weights)
    host.load_optimizer_state(resumed, state)
    assert [resumed.param_steps[n] for n in resumed.params] == [adapter.param_steps.get(n, 0) for n in adapter.params]
    renamed = {n.replace("run-adamw-b", "run-adamw-c"): p for n, p in params.items()}
    for step in (5, 6):  # the resumed run keeps matching torch
        _step_both(host, resumed, renamed, opt, step)
        assert _max_diff(resumed, renamed) < 1e-6, step

    old_format = {k: v for k, v in state.items() if not k.startswith("step::")}
    legacy = host.create_adapter("run-adamw-d", LoraSpec(rank=4, seed=5))
    host.load_optimizer_state(legacy, old_format)
    assert set(legacy.param_steps.values()) == {int(state["optim_steps"][0])}
    with pytest.raises(Exception, match="layout"):
        host.load_optimizer_state(legacy, {**old_format, "step::bogus": torch.tensor([1])})


def test_optim_step_without_gradients_leaves_weights_alone_over_http(worker, service):
    """Before the fix an optim_step with no pending gradients still moved the weights (decay + stale momentum)."""
    from server_mock.storage.checkpoints import CheckpointStore, parse_path

    tc = service.create_lora_training_client("tiny", rank=4, seed=8)
    tc.forward_backward([datum()]).result()
    adam = trio.AdamParams(learning_rate=5e-2, weight_decay=0.5)
    tc.optim_step(adam).result()
    store = CheckpointStore(worker.storage)

    def weights_and_moments(name: str) -> dict[str, bytes]:
        prints = store.fingerprint(parse_path(tc.save_state(name).result().path))
        return {k: v for k, v in prints.items() if not k.endswith(":optim_steps")}  # the call count moves on

    before = weights_and_moments("no-grad-before")
    tc.optim_step(adam).result()  # nothing accumulated since the last step
    assert weights_and_moments("no-grad-after") == before
    assert httpx.get(worker.base_url + "/v1/health").status_code == 200


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_global_norm_clipping_scales_every_gradient_and_reports_the_norm_before(host, clip):
    """Clipping at ``clip``: every gradient is scaled by clip / (norm + 1e-6) when the global norm is over it
    (written out here with plain tensor arithmetic), else left alone; ``grad_norm`` is the unclipped norm."""
    adapter = host.create_adapter(f"run-adamw-clip-{int(clip * 100)}", LoraSpec(rank=4, seed=6))
    adam = ADAM.model_copy(update={"grad_clip_norm": clip, "eps": 1e-3})  # an eps the clipped scale shows through
    params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in adapter.params.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                            eps=adam.eps, weight_decay=adam.weight_decay, foreach=False)
    for step in (1, 3, 4):
        grads = _grads(adapter, step)
        given = [g for g in grads.values() if g is not None]
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in given)))
        scale = clip / (norm + 1e-6) if norm > clip else 1.0
        for name, grad in grads.items():
            adapter.params[name].grad = None if grad is None else grad.clone()
            params[name].grad = None if grad is None else grad.clone() * scale
        metrics = host.optim_step(adapter, adam)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert _max_diff(adapter, params) < 1e-6, step
    if clip < 1:
        assert norm > 10 * clip  # the small bound really clipped (the large one never does)
