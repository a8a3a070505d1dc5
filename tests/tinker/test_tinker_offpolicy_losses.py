"""stable_reinforce, gspo and soft-target cross-entropy through the official ``tinker`` SDK against a real worker:
sampling with ``record_stability_info``, datums with provenance as the cookbook builds them, and each loss
checked against a numpy computation from the returned logprobs and the sampler's numbers. The group's datums
share a 40-token prompt, so the worker runs it once for them (prefix sharing)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tinker
import torch
from tinker import types

KEY = "tml-provenance"
PROMPT = [1] + [(13 * i) % 400 + 20 for i in range(39)]  # 40 tokens: a group's datums share them (prefix sharing)


@pytest.fixture(scope="module")
def worker(worker_factory):
    return worker_factory(api_keys=[KEY])


@pytest.fixture()
def sc(worker):
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=worker.base_url, api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


def rl_datum(seq, advantage: float, *, loss: str, client_logprobs: float | None = None) -> types.Datum:
    """rl_loop's datum: input = prompt + sampled[:-1], targets = [0] * (P - 1) + sampled; provenance as its
    ``with_sampled_provenance`` builds it."""
    p, s = len(PROMPT), len(seq.tokens)
    model_input = types.ModelInput.from_ints(PROMPT + seq.tokens[:-1])
    lps = list(seq.logprobs) if client_logprobs is None else [client_logprobs] * s
    inputs = {"target_tokens": torch.tensor([0] * (p - 1) + seq.tokens),
              "logprobs": torch.tensor([0.0] * (p - 1) + lps),
              "advantages": torch.tensor([0.0] * (p - 1) + [advantage] * s)}
    if loss == "gspo":
        inputs["sequence_ratio_mask"] = torch.tensor([0.0] * (p - 1) + [1.0] * s)
    datum = types.Datum(model_input=model_input, loss_fn_inputs=inputs)
    if loss == "stable_reinforce":
        datum = datum.with_provenance(
            model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=p),
                         types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=s - 1)],
            loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=p - 1),
                            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=s)])
    return datum


def sampled_group(tc, n: int = 3, record: bool = True, max_tokens: int = 5):
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record)
    params = types.SamplingParams(max_tokens=max_tokens, seed=3, temperature=1.0, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), num_samples=n, sampling_params=params).result(60)


def test_stable_reinforce_reads_the_recorded_sampler_logprobs(sc):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=1).result(timeout=60)
    group = sampled_group(tc)
    advantages = [1.0, -0.5, 0.25]
    # a first step moves the weights away from the sampler's, so the ratios are not all 1
    tc.forward_backward([rl_datum(s, a, loss="importance_sampling") for s, a in zip(group.sequences, advantages)],
                        "importance_sampling").result(60)
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result(60)
    kl = 0.2
    # the client's logprobs are deliberately wrong: the loss must use what the worker recorded
    datums = [rl_datum(s, a, loss="stable_reinforce", client_logprobs=-3.0)
              for s, a in zip(group.sequences, advantages)]
    out = tc.forward_backward(datums, "stable_reinforce", {"kl_coeff": kl}).result(60)
    p = len(PROMPT)
    total, count, moved = 0.0, 0, 0.0
    for seq, a, result in zip(group.sequences, advantages, out.loss_fn_outputs):
        lp = result["logprobs"].to_numpy().astype(np.float64)[p - 1:]
        mu = np.asarray(seq.logprobs, dtype=np.float64)
        r = np.exp(lp - mu)
        total += float(np.sum(-np.minimum(r, 1.0) * a * lp + kl * (r - 1 - np.log(r))))
        count += len(lp)
        moved = max(moved, float(np.abs(lp - mu).max()))
        elementwise = result["elementwise_loss"].to_numpy()
        assert np.all(elementwise[:p - 1] == 0)  # prompt positions contribute nothing
    assert moved > 1e-3  # the weights did move: the comparison exercises r != 1
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    assert out.metrics["token_count:sum"] == count


def test_stable_reinforce_refusals_name_the_problem(sc, worker):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=2).result(timeout=60)
    group = sampled_group(tc, n=2)
    seq = group.sequences[0]

    def failure(datums, config=None) -> str:
        with pytest.raises(tinker.RequestFailedError) as e:
            tc.forward_backward(datums, "stable_reinforce", config).result(60)
        return str(e.value)

    plain = rl_datum(seq, 1.0, loss="importance_sampling")  # no provenance
    assert "needs provenance on every datum" in failure([plain])
    unrecorded = sampled_group(tc, n=1, record=False).sequences[0]
    assert "is not held by this worker" in failure([rl_datum(unrecorded, 1.0, loss="stable_reinforce")])
    swapped = rl_datum(seq, 1.0, loss="stable_reinforce")
    other = group.sequences[1]
    wrong = types.Datum(model_input=swapped.model_input,
                        loss_fn_inputs={**swapped.loss_fn_inputs,
                                        "target_tokens": torch.tensor([0] * (len(PROMPT) - 1) + other.tokens)},
                        model_input_spans=swapped.model_input_spans, loss_fn_input_spans=swapped.loss_fn_input_spans)
    if other.tokens != seq.tokens:
        assert "target_tokens" in failure([wrong])
    prompt_advantage = types.Datum(
        model_input=swapped.model_input,
        loss_fn_inputs={**swapped.loss_fn_inputs, "advantages": torch.tensor([0.5] * swapped.model_input.length)},
        model_input_spans=swapped.model_input_spans, loss_fn_input_spans=swapped.loss_fn_input_spans)
    assert "only accepts nonzero advantages on sampled tokens" in failure([prompt_advantage])
    assert "kl_coeff: must be >= 0" in failure([swapped], {"kl_coeff": -1.0})
    # a sequence sampled in another session does not belong to this one
    other_sc = tinker.ServiceClient(base_url=worker.base_url, api_key=KEY)
    try:
        other_tc = other_sc.create_lora_training_client("tiny", rank=4, seed=2).result(timeout=60)
        foreign = sampled_group(other_tc, n=1).sequences[0]
    finally:
        other_sc.close("success").result(timeout=30)
    message = failure([rl_datum(foreign, 1.0, loss="stable_reinforce")])
    assert "another session" in message or "is not held" in message  # (its session has finished since)
    # after all those failed futures, the model still trains
    tc.forward_backward([swapped], "stable_reinforce").result(60)


def test_gspo_sequence_ratio(sc):
    tc = sc.create_lora_training_client("tiny", rank=4, seed=3).result(timeout=60)
    group = sampled_group(tc, record=False)
    old = [list(s.logprobs) for s in group.sequences]
    tc.forward_backward([rl_datum(s, 1.0, loss="importance_sampling") for s in group.sequences],
                        "importance_sampling").result(60)
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result(60)
    advantages = [1.0, -1.0, 0.5]
    datums = [rl_datum(s, a, loss="gspo") for s, a in zip(group.sequences, advantages)]
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}
    out = tc.forward_backward(datums, "gspo", config).result(60)
    p, total = len(PROMPT), 0.0
    for q, a, result in zip(old, advantages, out.loss_fn_outputs):
        lp = result["logprobs"].to_numpy().astype(np.float64)[p - 1:]
        s = float(np.exp(np.mean(lp - np.asarray(q))))
        total += len(lp) * -min(s * a, min(max(s, 0.9), 1.05) * a)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)


def test_soft_targets_through_the_sdk(sc):
    """(N, K) targets and weights, as off-policy top-K distillation sends them: dense TensorData and a sparse
    torch tensor (the SDK sends CSR); the logprobs come back [N, K] and match K one-column forward passes."""
    tc = sc.create_lora_training_client("tiny", rank=4, seed=4).result(timeout=60)
    tokens = [1, 40, 41, 42, 43, 44, 45]
    n, k = len(tokens), 3
    rng = np.random.default_rng(0)
    targets = rng.integers(3, 500, (n, k))
    weights = rng.uniform(0, 1, (n, k)).astype(np.float32)
    weights[rng.random((n, k)) < 0.5] = 0.0  # sparse enough that the SDK sends CSR
    dense = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets),
                                        "weights": types.TensorData.from_numpy(weights)})
    sparse = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                         loss_fn_inputs={"target_tokens": torch.tensor(targets), "weights": torch.tensor(weights)})
    hard = types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": targets[:, 0].tolist()})
    out = tc.forward([dense, sparse, hard], "cross_entropy").result(60)
    columns = [tc.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens),
                                       loss_fn_inputs={"target_tokens": targets[:, j].tolist()})],
                          "cross_entropy").result(60).loss_fn_outputs[0]["logprobs"].to_numpy() for j in range(k)]
    expected = np.stack(columns, axis=1)
    for result in out.loss_fn_outputs[:2]:
        got = result["logprobs"].to_numpy().reshape(result["logprobs"].shape)
        assert list(result["logprobs"].shape) == [n, k]
        np.testing.assert_allclose(got, expected, atol=1e-5)
    np.testing.assert_allclose(out.loss_fn_outputs[2]["logprobs"].to_numpy(), expected[:, 0], atol=1e-5)
    loss = 2 * float(-(weights * expected).sum()) - float(expected[:, 0].sum())
    assert out.metrics["loss:sum"] == pytest.approx(loss, rel=1e-5, abs=1e-5)
