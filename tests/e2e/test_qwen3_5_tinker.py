"""The recipes' default family (Qwen3.5: linear attention mixed with full attention) through the official
``tinker`` client: a GRPO group of eight samples, with logprobs equal to the trainer's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import tinker
from tinker import types

from server_mock.engine.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(300)
KEY = "qwen-key"


@pytest.fixture(scope="module")
def qwen_worker(tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("qwen3_5")
    folder = make_tiny_model(root / "qwen3_5", arch="qwen3_5", seed=3)
    proc = InProcessWorker(folder, root / "storage", api_keys=[KEY], model_name=str(folder)).start()
    yield proc, str(folder)
    proc.stop()


def test_group_of_eight_through_the_tinker_protocol(qwen_worker):
    proc, model = qwen_worker
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=proc.base_url, api_key="tml-" + KEY)
    try:
        tc = client.create_lora_training_client(base_model=model, rank=4)
        prompt = tc.get_tokenizer().encode("what is 12 + 30? the answer is")
        sampler = tc.save_weights_and_get_sampling_client(name="qwen3_5-step0")
        res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=8,
                             sampling_params=types.SamplingParams(max_tokens=12, seed=4)).result(timeout=120)
        assert len(res.sequences) == 8
        assert len({tuple(s.tokens) for s in res.sequences}) > 1
        data = [types.Datum(model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                            loss_fn_inputs={"target_tokens": (prompt + s.tokens)[1:]}) for s in res.sequences]
        out = tc.forward(data, "cross_entropy").result(timeout=120)
        gap = max(float(np.abs(o["logprobs"].to_numpy()[len(prompt) - 1:] - np.asarray(s.logprobs)).max())
                  for o, s in zip(out.loss_fn_outputs, res.sequences))
        assert gap <= 1e-5, gap
    finally:
        client.close("success").result(timeout=30)
