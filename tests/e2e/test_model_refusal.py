"""A model the worker cannot sample or train is refused with a 4xx naming its type and what is missing."""

from __future__ import annotations

import pytest
import torch
import transformers

import pytrio_compat as trio
from server_mock.engine.tiny_model import build_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def refusing_worker(tmp_path_factory, tiny_model_dir):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("refusal")
    tok = build_tiny_tokenizer()
    # an encoder-decoder: transformers has no causal-LM class for it
    transformers.T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=1, num_heads=2).save_pretrained(
        root / "t5")
    # GPT-2 keeps its attention and MLP weights in Conv1D, not nn.Linear: nothing for LoRA to adapt
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1,
                                                                n_head=2)).to(torch.float32)
    gpt2.save_pretrained(root / "gpt2")
    tok.save_pretrained(root / "gpt2")
    proc = InProcessWorker(tiny_model_dir, root / "storage", "--model", f"t5={root / 't5'}", "--model",
                           f"gpt2={root / 'gpt2'}").start()
    client = trio.ServiceClient(base_url=proc.base_url)
    yield client
    client.close()
    proc.stop()


@pytest.mark.parametrize(("model", "missing"), [("t5", "no causal-LM class"), ("gpt2", "nn.Linear")])
def test_unservable_model_is_refused_naming_type_and_reason(refusing_worker, model, missing):
    for attempt in (lambda: refusing_worker.create_lora_training_client(model, rank=4),
                    lambda: refusing_worker.create_sampling_client(base_model=model)):
        with pytest.raises(trio.PyTrioError) as info:
            attempt()
        text = str(info.value)
        assert "model_not_supported" in text or "cannot be served" in text
        assert f"'{model}'" in text and missing in text
    # the served model next to them is unaffected
    tc = refusing_worker.create_lora_training_client("tiny", rank=4, seed=0)
    assert tc.get_tokenizer().encode("1 + 1")
