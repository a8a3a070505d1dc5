"""The demos' evaluation submits its prompts together, so the worker decodes them as batches; each problem must get
exactly the greedy tokens it gets decoded alone (so the accuracy is the same to the last problem)."""

from pathlib import Path

import pytest

import pytrio_compat as trio
from pytrio_compat import config as sdk_config
from recipes.grpo_lib import EVAL_GRADERS, PROMPTS, accuracy, greedy_results, load_rows, row_prompt

FIXTURE = str(Path(__file__).resolve().parent / "fixtures" / "gsm8k_tiny.jsonl")
MAX_TOKENS = 8


def _greedy(worker, monkeypatch, tmp_path: Path, in_flight: int):
    monkeypatch.setattr(sdk_config, "_CONFIG", sdk_config.snapshot())  # this test's configure() stays here
    trio.configure(sampling_request_max_in_flight=in_flight)
    monkeypatch.setenv("PYTRIO_COMPAT_CACHE", str(tmp_path / "cache"))
    with trio.ServiceClient(base_url=worker.base_url) as service:
        training = service.create_lora_training_client("tiny", rank=8, seed=5)
        tokenizer = training.get_tokenizer()
        sampler = training.save_weights_and_get_sampling_client()
        # additions and GSM8K questions: prompts of different lengths, so a batch left-pads them
        rows = load_rows("arithmetic", "test", n=12) + load_rows("gsm8k", "test", FIXTURE)
        fewshot, suffix = PROMPTS["arithmetic"]
        results = greedy_results(sampler, tokenizer, rows, MAX_TOKENS, fewshot, suffix)
        lengths = {len(row_prompt(tokenizer, row, fewshot, suffix)) for row in rows}
        assert len(lengths) > 1
        return results, accuracy(tokenizer, results, rows, EVAL_GRADERS["arithmetic"])


def test_batched_evaluation_gives_every_problem_its_own_greedy_tokens(worker, monkeypatch, tmp_path):
    alone, alone_accuracy = _greedy(worker, monkeypatch, tmp_path, in_flight=1)
    # one request at a time: each decoded in a batch of its own
    assert [r.metrics["batch_requests"] for r in alone] == [1.0] * len(alone)
    # the SDK's default of 16 in flight (the demos' evaluation: requests join as others end), and all at once
    for in_flight in (16, 64):
        batched, batched_accuracy = _greedy(worker, monkeypatch, tmp_path, in_flight=in_flight)
        assert max(r.metrics["batch_requests"] for r in batched) >= len(batched) / 2  # decoded together
        for i, (a, b) in enumerate(zip(alone, batched)):
            assert list(b.sequences[0].tokens) == list(a.sequences[0].tokens), (in_flight, i)
            assert b.sequences[0].logprobs == pytest.approx(a.sequences[0].logprobs, abs=1e-4), (in_flight, i)
        assert batched_accuracy == alone_accuracy
