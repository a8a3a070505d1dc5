"""Fixtures for the recipe tests: import paths, a tiny offline chat tokenizer, a fake service, and a demo run
against a real worker.

The fake service answers like the PyTRIO clients (futures, async twins, SampleResponse, ForwardBackwardOutput)
but needs no worker, so the demo scripts can be run in-process and their step logic checked exactly.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
for _p in (str(REPO),):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from recipe_fakes import FakeService

# ChatML, with Qwen3's behaviour for enable_thinking=False (an empty think block opens the answer), so a
# test can see that render_prompt passes the flag through.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [f"What is {a} + {b}? \\boxed{{{a + b}}}" for a in range(10, 60) for b in range(10, 30)]
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def recipe_tokenizer():
    """A 400-token BPE trained on the arithmetic prompts, with Qwen3's enable_thinking behaviour (not the tiny
    models' tokenizer, ``tiny_tokenizer``)."""
    return build_tiny_tokenizer()


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


# --------------------------------------------------------------------------------------------------------
# A fake service for running the demos in-process
# --------------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_service(monkeypatch, recipe_tokenizer):
    """Installs a FakeService as `pytrio_compat.ServiceClient` (and a recording `configure`)."""
    import pytrio_compat

    service = FakeService(recipe_tokenizer)
    monkeypatch.setattr(pytrio_compat, "ServiceClient", service.service_client_class(), raising=False)

    def configure(**kwargs):  # every call's options, merged (a later call's win, as trio.configure's do)
        service.configure_kwargs = {**(service.configure_kwargs or {}), **kwargs}

    monkeypatch.setattr(pytrio_compat, "configure", configure, raising=False)
    monkeypatch.syspath_prepend(str(RECIPES))
    return service


@pytest.fixture
def load_demo():
    """Imports a demo script (`01-demo-sync.py` / `02-demo-async.py`) as a fresh module."""
    counter = [0]

    def load(filename: str):
        counter[0] += 1
        spec = importlib.util.spec_from_file_location(f"_demo_{counter[0]}", RECIPES / filename)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def demo_on_worker(worker, load_demo, tmp_path, monkeypatch):
    """``run(script, *flags, reward="grade")``: the demo against the ``worker`` fixture (the tiny random model), two
    prompts of four completions of at most six tokens a step, rank 8, seed 3, logs in ``tmp_path / "run"``.
    The tiny model never answers right, so the demo's ``reward`` (``grade``, or ``countdown_reward``) is replaced by
    one alternating 1, 0 within each group: every group is mixed and every step trains. ``flags`` come last (and
    may override these). Returns the demo's summary and the completions it rewarded."""
    monkeypatch.syspath_prepend(str(RECIPES))

    def run(script: str, *flags: str, reward: str = "grade") -> tuple[dict, list[str]]:
        demo = load_demo(script)
        calls: list[str] = []

        def alternating_reward(text, answer):
            calls.append(text)
            return float(len(calls) % 2)

        monkeypatch.setattr(demo, reward, alternating_reward)
        summary = demo.main([
            "--base-url", worker.base_url, "--base-model", "tiny", "--batch-size", "2", "--group-size", "4",
            "--max-tokens", "6", "--lora-rank", "8", "--seed", "3", "--log-dir", str(tmp_path / "run"), *flags])
        return summary, calls

    return run
