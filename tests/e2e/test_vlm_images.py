"""Image + text prompts and datums through the real HTTP worker on every protocol, on tiny random VLMs (Qwen3.5
with its vision tower, Gemma 3): group sampling with an image prompt, forward on datums built from the samples
(sampler-vs-trainer logprobs <= 1e-5), forward_backward + optim_step moving the weights, and the placeholder-count
check, through our SDK (native /v1), the official ``tinker`` SDK and ``openai``
(the official ``pytrio`` SDK: tests/pytrio/test_pytrio_vision.py)."""

from __future__ import annotations

import base64
import warnings

import numpy as np
import pytest

from vision_support import completion_inputs, image_tokens, pieces, png, png_declaring

import pytrio_compat as trio
from server_mock.engine.tiny_vlm import make_tiny_vlm

pytestmark = pytest.mark.timeout(600)
FAMILIES = ["qwen3_5", "gemma3"]
KEY = "vlm-key"
TOL = 1e-5


@pytest.fixture(scope="module")
def vlm_worker(tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("vlm-images")
    dirs = {f: make_tiny_vlm(root / f, arch=f, seed=2) for f in FAMILIES}
    extra = [arg for f in FAMILIES[1:] for arg in ("--model", f"{f}={dirs[f]}")]
    proc = InProcessWorker(dirs[FAMILIES[0]], root / "storage", *extra, api_keys=[KEY],
                           model_name=FAMILIES[0]).start()
    yield proc, dirs
    proc.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_our_sdk_samples_a_group_on_an_image_and_trains_on_it(vlm_worker, family):
    proc, dirs = vlm_worker
    client = trio.ServiceClient(base_url=proc.base_url, api_key=KEY)
    try:
        tc = client.create_lora_training_client(family, rank=4, seed=1)
        before, after = pieces(tc.get_tokenizer(), family)
        data_png = png(40, 24, 1)
        count = image_tokens(dirs[family], data_png)
        chunks = [trio.types.EncodedTextChunk(tokens=before), trio.ImageChunk(data=data_png, format="png"),
                  trio.types.EncodedTextChunk(tokens=after)]  # expected_tokens left out: the worker fills it in
        sampler = tc.save_weights_and_get_sampling_client(name=f"{family}-img0")
        params = trio.SamplingParams(max_tokens=8, seed=3, stop=[])
        group = sampler.sample(trio.ModelInput(chunks=chunks), num_samples=4, sampling_params=params).result()
        n_prompt = len(before) + count + len(after)
        assert group.input_tokens == n_prompt  # the client's count of the prompt, image included
        assert len(group.sequences) == 4 and len({tuple(s.tokens) for s in group.sequences}) > 1
        counted = [chunks[0], trio.ImageChunk(data=data_png, format="png", expected_tokens=count), chunks[2]]
        text = trio.types.EncodedTextChunk
        data = [trio.Datum(model_input=trio.ModelInput(chunks=counted + [text(tokens=s.tokens[:-1])]),
                           loss_fn_inputs=completion_inputs(n_prompt, s.tokens)) for s in group.sequences]
        out = tc.forward(data, "cross_entropy").result()
        for o, s in zip(out.loss_fn_outputs, group.sequences):
            trained = np.asarray(o["logprobs"].data)[n_prompt - 1:]
            assert float(np.abs(trained - np.asarray(s.logprobs)).max()) <= TOL
        fb = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(trio.AdamParams(learning_rate=5e-3)).result()
        later = tc.forward(data, "cross_entropy").result()
        assert later.metrics["loss_sum"] < fb.metrics["loss_sum"]  # the step moved the weights, downhill
        wrong = [chunks[0], trio.ImageChunk(data=data_png, format="png", expected_tokens=count + 1), chunks[2]]
        with pytest.raises(trio.PyTrioError) as err:
            sampler.sample(trio.ModelInput(chunks=wrong), num_samples=1,
                           sampling_params=trio.SamplingParams(max_tokens=2)).result()
        assert "image_token_mismatch" in str(err.value) or "expected_tokens" in str(err.value)
        assert f"counted {count + 1} tokens" in str(err.value) and f"makes {count}" in str(err.value)
    finally:
        client.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_tinker_sdk_samples_and_trains_on_an_image(vlm_worker, family):
    import tinker
    from tinker import types

    proc, dirs = vlm_worker
    warnings.simplefilter("ignore", FutureWarning)
    client = tinker.ServiceClient(base_url=proc.base_url, api_key="tml-" + KEY)
    try:
        tc = client.create_lora_training_client(base_model=family, rank=4)
        before, after = pieces(tc.get_tokenizer(), family)
        data_png = png(32, 32, 2)
        count = image_tokens(dirs[family], data_png)
        chunks = [types.EncodedTextChunk(tokens=before),
                  types.ImageChunk(data=data_png, format="png", expected_tokens=count),
                  types.EncodedTextChunk(tokens=after)]
        prompt = types.ModelInput(chunks=chunks)
        assert prompt.length == len(before) + count + len(after)
        sampler = tc.save_weights_and_get_sampling_client(name=f"{family}-tinker-img")
        res = sampler.sample(prompt, num_samples=4,
                             sampling_params=types.SamplingParams(max_tokens=8, seed=4)).result(timeout=120)
        assert len(res.sequences) == 4
        n = prompt.length
        text = types.EncodedTextChunk
        data = [types.Datum(model_input=types.ModelInput(chunks=chunks + [text(tokens=s.tokens[:-1])]),
                            loss_fn_inputs=completion_inputs(n, s.tokens)) for s in res.sequences if s.tokens]
        out = tc.forward(data, "cross_entropy").result(timeout=120)
        gap = max(float(np.abs(o["logprobs"].to_numpy()[n - 1:] - np.asarray(s.logprobs)).max())
                  for o, s in zip(out.loss_fn_outputs, [s for s in res.sequences if s.tokens]))
        assert gap <= TOL, gap
        first = tc.forward_backward(data, "cross_entropy").result(timeout=120)
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result(timeout=120)
        second = tc.forward(data, "cross_entropy").result(timeout=120)
        assert second.metrics["loss:sum"] < first.metrics["loss:sum"]
        wrong = types.ModelInput(chunks=[chunks[0], types.ImageChunk(data=data_png, format="png",
                                                                     expected_tokens=count - 1), chunks[2]])
        with pytest.raises(Exception) as err:  # noqa: B017 - the SDK's own error type for a failed future
            sampler.sample(wrong, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result(timeout=60)
        assert f"counted {count - 1} tokens" in str(err.value) and f"makes {count}" in str(err.value)
    finally:
        client.close("success").result(timeout=30)


def test_openai_chat_takes_data_url_images_and_refuses_remote_ones(vlm_worker):
    import openai
    from transformers import AutoTokenizer

    proc, dirs = vlm_worker
    client = openai.OpenAI(base_url=proc.base_url + "/api/openai/v1", api_key=KEY)
    data_png = png(40, 24, 4)
    url = "data:image/png;base64," + base64.b64encode(data_png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "how many shapes?"}]
    for family in FAMILIES:
        out = client.chat.completions.create(model=family, messages=[{"role": "user", "content": content}],
                                             max_tokens=6, n=3, seed=2, logprobs=True)
        assert len(out.choices) == 3
        count = image_tokens(dirs[family], data_png)
        # the usage counts the image's tokens: the rendered text without the template's one marker, plus the image
        tok = AutoTokenizer.from_pretrained(dirs[family])
        rendered = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, content[1]]}],
                                           tokenize=False, add_generation_prompt=True)
        assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False)) - 1 + count
        assert all(len(c.logprobs.content) >= 1 for c in out.choices)
    for bad, words in [("https://example.com/cat.png", "not fetched"), ("data:image/gif;base64,R0lG", "png"),
                       ("data:image/png;base64,@@@", "base64")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="qwen3_5", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": bad}}, {"type": "text", "text": "hi"}]}])
        assert words in str(err.value) and "messages[0].content[0].image_url.url" in str(err.value)
    bomb = "data:image/png;base64," + base64.b64encode(png_declaring(30000, 30000)).decode()
    with pytest.raises(openai.APIStatusError) as err:  # refused from its header, named by the part it came in
        client.chat.completions.create(model="gemma3", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": bomb}}]}])
    assert err.value.status_code == 413 and "max_image_pixels" in str(err.value)
    assert err.value.body["param"] == "messages[0].content[1].image_url.url"
    with pytest.raises(openai.BadRequestError) as err:  # a text-only request names what is missing
        client.chat.completions.create(model="qwen3_5", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}], logprobs=True, top_logprobs=2)
    assert "top_logprobs" in str(err.value)
