"""Training through the real HTTP worker, checked against an independent local computation.

The reference side loads the same tiny model in this process, loads the adapter the worker saved
(a standard PEFT folder), computes each loss from its textbook formula, and steps torch.optim.AdamW.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from support import moved_state
from transformers import AutoModelForCausalLM

import pytrio_compat as trio

pytestmark = pytest.mark.timeout(300)


def checkpoint_folder(worker, path: str) -> Path:
    run, kind, name = path[len("trio://"):].split("/")
    return worker.storage / "checkpoints" / run / kind / name


def local_model(tiny_model_dir, folder: Path, trainable: bool = False):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder), is_trainable=trainable)
    model.eval()
    return model


def local_logprobs(model, tokens: list[int], targets: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    safe = torch.tensor([t if t >= 0 else 0 for t in targets])
    return logp.gather(-1, safe[:, None])[:, 0]


def reference_loss(name: str, lp: torch.Tensor, inputs: dict, cfg: dict) -> torch.Tensor:
    """Textbook formulas, written out per token, summed (Tinker's reduction)."""
    total = lp.new_zeros(())
    targets = inputs["target_tokens"]
    for i in range(len(targets)):
        if targets[i] == -100:
            continue
        if name == "cross_entropy":
            total = total - inputs.get("weights", [1.0] * len(targets))[i] * lp[i]
            continue
        q, a = inputs["logprobs"][i], inputs["advantages"][i]
        ratio = torch.exp(lp[i] - q)
        if name == "importance_sampling":
            total = total - ratio * a
        elif name == "ppo":
            lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
            total = total - torch.minimum(ratio * a, torch.clamp(ratio, lo, hi) * a)
        elif name == "cispo":
            lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
            total = total - torch.clamp(ratio, lo, hi).detach() * lp[i] * a
        elif name == "dro":
            beta = cfg.get("beta", 0.05)
            total = total - (lp[i] * a - 0.5 * beta * (lp[i] - q) ** 2)
    return total


def make_batch(tokenizer, rng: np.random.Generator, with_policy: bool) -> list[trio.Datum]:
    texts = ["12 + 30 = 42. The answer is 42.", "7 + 8 = 15", "what is 3 + 4? it is 7."]
    data = []
    for text in texts:
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        target = list(ids[1:])
        target[0] = -100  # an ignored position must stay out of the loss
        inputs = {"target_tokens": target}
        if with_policy:
            inputs["logprobs"] = (-rng.uniform(0.5, 4.0, n)).astype(np.float32)
            inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
        else:
            inputs["weights"] = rng.uniform(0.2, 1.5, n).astype(np.float32)
        data.append(trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    return data


@pytest.fixture()
def trained_state(service, worker):
    """A run moved away from its initial weights (LoRA B != 0), saved with save_state."""
    return moved_state(service)


@pytest.mark.parametrize("loss_fn,cfg", [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", None),
    ("dro", {"beta": 0.3}),
])
def test_loss_gradient_and_adam_step_match_local_reference(service, worker, tiny_model_dir, trained_state,
                                                           loss_fn, cfg):
    path, tok = trained_state
    tc = service.create_training_client_from_state(path)  # same weights, fresh optimizer
    data = make_batch(tok, np.random.default_rng(0), loss_fn != "cross_entropy")
    adam = trio.AdamParams(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    fb = tc.forward_backward(data, loss_fn, cfg)
    op = tc.optim_step(adam)
    out, step = fb.result(), op.result()
    after = checkpoint_folder(worker, tc.save_weights_for_sampler("after").result().path)

    model = local_model(tiny_model_dir, checkpoint_folder(worker, path), trainable=True)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    total = torch.zeros(())
    for i, datum in enumerate(data):
        inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
        lp = local_logprobs(model, datum.model_input.to_ints(), inputs["target_tokens"])
        served = np.asarray(out.loss_fn_outputs[i]["logprobs"].data)
        mask = np.asarray(inputs["target_tokens"]) != -100
        assert np.abs(served[mask] - lp.detach().numpy()[mask]).max() < 1e-5
        total = total + reference_loss(loss_fn, lp, inputs, cfg or {})
    assert out.metrics["loss_sum"] == pytest.approx(float(total), rel=1e-5, abs=1e-5)
    assert out.metrics["loss:sum"] == out.metrics["loss_sum"]
    assert out.metrics["loss_mean"] == pytest.approx(out.metrics["loss_sum"] / out.metrics["token_count"])

    total.backward()
    local_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
    assert step.metrics["grad_norm"] == pytest.approx(local_norm, rel=1e-4)
    torch.optim.AdamW(params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                      weight_decay=adam.weight_decay).step()
    served_after = local_model(tiny_model_dir, after)
    expected = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    got = {n: p.detach() for n, p in served_after.named_parameters() if "lora_" in n}
    assert expected.keys() == got.keys()
    worst = max(float((expected[n] - got[n]).abs().max()) for n in expected)
    # Adam's first step moves each element by ~lr * g / (|g| + eps): for an element whose gradient is close to
    # zero, a float32 rounding difference in g (the gradients agree to rel 1e-4 above) changes its step by a
    # visible fraction of lr. 1% of one step (lr = 1e-3) bounds that; a wrong update moves weights by ~lr.
    assert worst < 1e-2 * adam.learning_rate, f"weights after one AdamW step differ by {worst}"


def test_token_count_and_ignore_index(service):
    tc = service.create_lora_training_client("tiny", rank=4, seed=1)
    ids = list(range(10, 20))
    weights = [0.0, 1.0, 1.0, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    targets = ids[1:]
    targets[5] = -100
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": targets, "weights": weights})
    out = tc.forward([datum]).result()
    # positions counted: weight != 0 and target != -100 -> 9 - 2 zero weights - 1 ignored = 6
    assert out.metrics["token_count"] == 6.0
    lp = np.asarray(out.loss_fn_outputs[0]["logprobs"].data)
    assert lp[5] == 0.0
    expected = -sum(w * x for w, x, t in zip(weights, lp, targets) if t != -100)
    assert out.metrics["loss_sum"] == pytest.approx(expected, rel=1e-6)


def test_sampler_logprobs_agree_with_trainer_forward(service, trained_state):
    path, tok = trained_state
    tc = service.create_training_client_from_state(path)
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = tok.encode("5 + 9 =")
    worst = 0.0
    for temperature in (1.0, 0.7):
        res = sampler.sample(trio.ModelInput.from_ints(prompt), num_samples=4,
                             sampling_params=trio.SamplingParams(max_tokens=24, temperature=temperature, seed=11,
                                                                 stop=[])).result()
        data = []
        for seq in res.sequences:
            full = prompt + seq.tokens
            data.append(trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]),
                                   loss_fn_inputs={"target_tokens": full[1:]}))
        fwd = tc.forward(data).result()
        for seq, out in zip(res.sequences, fwd.loss_fn_outputs):
            trainer = np.asarray(out["logprobs"].data)[len(prompt) - 1:]
            worst = max(worst, float(np.abs(trainer - np.asarray(seq.logprobs)).max()))
    print(f"max |sampler - trainer| logprob = {worst:.3g}")
    assert worst < 1e-5  # measured ~1e-6 on the tiny models


def test_cross_entropy_learns_one_sequence(service):
    tc = service.create_lora_training_client("tiny", rank=8, seed=3)
    ids = tc.get_tokenizer().encode("The answer to 21 + 21 is 42.")
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    losses = []
    for _ in range(30):
        fb = tc.forward_backward([datum])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss_sum"])
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_importance_sampling_moves_completion_logprob_with_advantage(service, sign):
    tc = service.create_lora_training_client("tiny", rank=8, seed=5)
    tok = tc.get_tokenizer()
    prompt, completion = tok.encode("3 + 4 ="), tok.encode(" 7")
    full = prompt + completion
    n = len(full) - 1
    mask = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    probe = trio.Datum(model_input=trio.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})

    def completion_logprob() -> float:
        lp = tc.forward([probe]).result().loss_fn_outputs[0]["logprobs"].data
        return sum(x * m for x, m in zip(lp, mask))

    before = completion_logprob()
    for _ in range(5):
        lp = tc.forward([probe]).result().loss_fn_outputs[0]["logprobs"].data
        datum = trio.Datum(model_input=probe.model_input, loss_fn_inputs={
            "target_tokens": [0] * (len(prompt) - 1) + completion,
            "logprobs": [x * m for x, m in zip(lp, mask)],
            "advantages": [sign * m for m in mask],
        })
        tc.forward_backward([datum], "importance_sampling").result()
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    after = completion_logprob()
    assert (after - before) * sign > 0.05, (before, after)
    assert n == len(mask)


def test_new_sampler_after_optim_step_scores_like_the_trainer(service):
    tc = service.create_lora_training_client("tiny", rank=8, seed=9)
    ids = tc.get_tokenizer().encode("9 + 9 = 18, and 18 + 1 = 19.")
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    sampled = sampler.compute_logprobs(trio.ModelInput.from_ints(ids)).result()
    trained = tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].data
    assert sampled[0] is None
    assert np.abs(np.asarray(sampled[1:]) - np.asarray(trained)).max() < 1e-5
    base = service.create_sampling_client(base_model="tiny").compute_logprobs(trio.ModelInput.from_ints(ids)).result()
    assert np.abs(np.asarray(base[1:]) - np.asarray(trained)).max() > 1e-3  # the step changed the weights
