"""`--loss-fn cispo` (the worker's built-in loss, one pass) and `--custom-cispo` (the recipe's CISPO through
forward_backward_custom, two passes) make the same update: same loss, same gradient norm, same weights after
an Adam step, within 1e-5. Real worker (tiny random model), two adapters from the same seed."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

import pytrio_compat as trio
from recipes.grpo_lib import (
    build_arg_parser,
    build_datum,
    loss_fn_config,
    make_custom_cispo_loss,
    ratio_clip_fraction,
)

pytestmark = pytest.mark.timeout(300)
CLIP_LOW, CLIP_HIGH = 0.5, 2.0


def grpo_datums(seed: int = 0) -> list[trio.Datum]:
    """Two prompts x 4 completions with GRPO advantages and sampler logprobs far enough from the learner's
    (about -log(vocab) on random tokens) that the ratio falls below, inside and above the clip range."""
    rng = np.random.default_rng(seed)
    datums = []
    for _ in range(2):
        prompt = rng.integers(3, 400, 20).tolist()
        for advantage in (0.75, -0.25, -0.25, -0.25):
            completion = rng.integers(3, 400, int(rng.integers(3, 9))).tolist()
            sampler_logprobs = rng.uniform(-8.0, -4.0, len(completion)).tolist()
            datums.append(build_datum(prompt, completion, sampler_logprobs, advantage))
    return datums


def one_step(service, worker, datums, custom: bool):
    client = service.create_lora_training_client("tiny", rank=4, seed=5, train_unembed=True)
    args = build_arg_parser("t").parse_args(["--loss-fn", "cispo", "--cispo-clip-low", str(CLIP_LOW),
                                             "--cispo-clip-high", str(CLIP_HIGH)])
    if custom:
        out = client.forward_backward_custom(datums, make_custom_cispo_loss(CLIP_LOW, CLIP_HIGH)).result()
    else:
        out = client.forward_backward(datums, loss_fn="cispo", loss_fn_config=loss_fn_config(args)).result()
    step = client.optim_step(trio.AdamParams(learning_rate=1e-2, eps=1e-8)).result()
    path = client.save_weights_for_sampler("after").result().path
    run_id, kind, name = path[len("trio://"):].split("/")
    weights = load_file(str(worker.storage / "checkpoints" / run_id / kind / name / "adapter_model.safetensors"))
    learner = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs] if not custom else None
    return out, step, weights, learner


def test_native_cispo_matches_custom_cispo(worker):
    datums = grpo_datums()
    service = trio.ServiceClient(base_url=worker.base_url)
    try:
        native_out, native_step, native_w, learner = one_step(service, worker, datums, custom=False)
        custom_out, custom_step, custom_w, _ = one_step(service, worker, datums, custom=True)
    finally:
        service.close()

    # the data exercises both bounds: some ratios below CLIP_LOW, some above CLIP_HIGH, some inside
    trained = [d.loss_fn_inputs["advantages"].to_numpy() != 0 for d in datums]
    ratios = np.concatenate([np.exp(lp - d.loss_fn_inputs["logprobs"].to_numpy())[m]
                             for d, lp, m in zip(datums, learner, trained)])
    inside = (ratios > CLIP_LOW) & (ratios < CLIP_HIGH)
    assert (ratios < CLIP_LOW).any() and (ratios > CLIP_HIGH).any() and inside.any(), ratios

    # the recipe's clip fraction from the built-in loss's logprobs equals the one the custom loss reports
    clipped = ratio_clip_fraction(datums, native_out, CLIP_LOW, CLIP_HIGH)
    assert 0 < clipped < 1 and clipped == pytest.approx(custom_out.metrics["cispo/clip_fraction"])
    assert native_out.metrics["loss_mean"] == pytest.approx(custom_out.metrics["loss_mean"], rel=1e-5, abs=1e-6)
    assert native_step.metrics["grad_norm"] == pytest.approx(custom_step.metrics["grad_norm"], rel=1e-5)
    assert native_step.metrics["grad_norm"] > 0
    assert set(native_w) == set(custom_w)
    assert max(float((native_w[k] - custom_w[k]).abs().max()) for k in native_w) <= 1e-5
    # and the step did move the adapter (B starts at zero): the comparison is not between two no-ops
    assert max(float(native_w[k].abs().max()) for k in native_w if "lora_B" in k) > 1e-3


def test_loss_fn_config_carries_the_cispo_bounds():
    args = build_arg_parser("t").parse_args(["--loss-fn", "cispo", "--custom-cispo"])
    assert args.custom_cispo and loss_fn_config(args) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert loss_fn_config(build_arg_parser("t").parse_args(["--loss-fn", "ppo"])) is None
