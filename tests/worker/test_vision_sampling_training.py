"""Image chunks through the engine: a prompt with an image sampled as a group (prefilled once, decoded as text), the
same sequence trained on (forward / forward_backward, every loss), the sampler's logprobs equal to the trainer's
and to an independent full forward pass built here from the family's own processing, and the placeholder check.

Tiny random VLMs of each family (engine/tiny_vlm.py), on the worker's real ``LocalModelHost`` and service checks."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from pytrio_compat.types.model_input import ImageChunk
from pytrio_compat.wire import LoraSpec, SampleRequest, WireImage, WireSamplingParams
from server_mock.config import Limits, TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.errors import WorkerError
from server_mock.service.validation import validate_rows, validate_sample
from server_mock.training import losses

pytestmark = pytest.mark.timeout(600)
FAMILIES = ["qwen3_5", "gemma3", "qwen3_vl", "qwen2_5_vl", "llava"]
LIMITS = Limits()


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def hosts(tiny_vlm_dir):
    cache: dict[str, LocalModelHost] = {}

    def get(arch: str) -> LocalModelHost:
        if arch not in cache:
            cache[arch] = LocalModelHost(arch, str(tiny_vlm_dir(arch)), "cpu", torch.float32,
                                         options=TrainOptions(micro_batch_tokens=4096))
        return cache[arch]

    return get


def image(data: bytes, position: int, expected: int | None = None) -> WireImage:
    return WireImage(position=position, chunk=ImageChunk(data=data, format="png", expected_tokens=expected))


def text_ids(host: LocalModelHost, n: int, seed: int) -> list[int]:
    """Random ids of the tiny BPE vocabulary (below the image tokens, which start at 512)."""
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def sample_spec(host, prompt_text, images, n=4, max_tokens=6, seed=7, **params):
    params.setdefault("stop_token_ids", [])  # no stop unless asked, not even EOS
    request = SampleRequest(prompt_tokens=prompt_text, prompt_images=images, num_samples=n,
                            sampling_params=WireSamplingParams(max_tokens=max_tokens, seed=seed, **params))
    return validate_sample(request, host, LIMITS)


def independent_logprobs(host: LocalModelHost, ids: list[int], pixels: list[bytes]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) from one plain forward of the base model, its image inputs made here by the
    family's own processing and its positions left to transformers (the offsets it caches cleared first)."""
    model = host.peft.get_base_model() if host.peft is not None else host.model
    vision = host.vision
    pil = [Image.open(io.BytesIO(p)).convert("RGB") for p in pixels]
    ids_t = torch.tensor([ids])
    if vision.family.expansion == "grid":
        out = vision.image_processor(images=pil, return_tensors="pt")
        kwargs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                  "mm_token_type_ids": (ids_t == vision.image_token_id).long()}
    else:
        out = vision.image_processor(images=pil, return_tensors="pt")
        kwargs = {"pixel_values": out["pixel_values"]}
        if vision.family.type_ids:
            kwargs[vision.family.type_ids] = (ids_t == vision.image_token_id).long()
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None
    with torch.no_grad(), (host.peft.disable_adapter() if host.peft is not None else torch.no_grad()):
        logits = model(input_ids=ids_t, use_cache=False, **kwargs).logits.float()[0]
    for module in model.modules():
        if getattr(module, "rope_deltas", None) is not None:
            module.rope_deltas = None
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(-1, ids_t[0, 1:, None])[:, 0]


@pytest.mark.parametrize("arch", FAMILIES)
def test_group_sampling_with_an_image_matches_the_trainer_and_a_plain_forward(hosts, arch):
    host = hosts(arch)
    adapter = host.create_adapter(f"run-{arch}-agree", LoraSpec(rank=4, seed=0))
    pic = png(40, 24, seed=1)
    before, after = text_ids(host, 5, 0), text_ids(host, 3, 1)
    spec = sample_spec(host, before + after, [image(pic, len(before))], n=4, max_tokens=8, temperature=1.0)
    span = spec.images[0]
    assert spec.prompt_tokens[:len(before)] == before and spec.prompt_tokens[span.stop:] == after
    assert span.start == len(before) and span.image.n_tokens == len(spec.prompt_tokens) - 8
    snap = host.snapshot(adapter)
    timings: dict[str, float] = {}
    result = host.sample_batch(snap, [spec], timings)[0]
    assert len(result.sequences) == 4
    assert len({tuple(s.tokens) for s in result.sequences}) > 1  # four different completions of one prefill
    data = []
    for seq in result.sequences:
        assert vision_free(host, seq.tokens)
        tokens = np.asarray(before + after + seq.tokens[:-1], dtype=np.int64)
        n = len(spec.prompt_tokens) + len(seq.tokens) - 1
        targets = np.asarray((spec.prompt_tokens + seq.tokens)[1:], dtype=np.int64)
        weights = np.zeros(n, np.float32)
        weights[len(spec.prompt_tokens) - 1:] = 1
        data.append({"tokens": tokens, "target_tokens": targets, "weights": weights})
    rows = validate_rows("cross_entropy", data, host, LIMITS, [[image(pic, len(before))]] * len(data))
    out = host.forward_backward(adapter, rows, "cross_entropy", {}, backward=False)
    for seq, o in zip(result.sequences, out["outputs"]):
        trained = o["logprobs"][len(spec.prompt_tokens) - 1:]
        np.testing.assert_allclose(trained, seq.logprobs, atol=1e-5, rtol=0)
    # the base model (a fresh adapter's B is 0): the same numbers from a forward built without the worker's code
    seq = result.sequences[0]
    full = spec.prompt_tokens + seq.tokens
    ref = independent_logprobs(host, full, [pic])
    np.testing.assert_allclose(ref[len(spec.prompt_tokens) - 1:].numpy(), seq.logprobs, atol=1e-5, rtol=0)
    host.drop_adapter(adapter.adapter_id)


def vision_free(host, tokens: list[int]) -> bool:
    return host.vision.image_token_id not in tokens


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_coalesced_prompts_with_and_without_images_and_two_images(hosts, arch):
    """Several requests in one decoding batch (left-padded, one with two images, one text only): each gets what
    it gets alone, greedy."""
    host = hosts(arch)
    a, b = png(32, 32, 2), png(48, 16, 3)
    spec1 = sample_spec(host, text_ids(host, 3, 2) + text_ids(host, 4, 3), [image(a, 3), image(b, 5)], n=2,
                        temperature=0.0)
    spec2 = sample_spec(host, text_ids(host, 9, 4), [image(b, 9)], n=1, temperature=0.0)
    spec3 = sample_spec(host, text_ids(host, 6, 5), None, n=2, temperature=0.0)
    together = host.sample_batch(None, [spec1, spec2, spec3], {})
    for spec, got in zip([spec1, spec2, spec3], together):
        alone = host.sample_batch(None, [spec], {})[0]
        for x, y in zip(got.sequences, alone.sequences):
            assert x.tokens == y.tokens
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    two = spec1.prompt_tokens + together[0].sequences[0].tokens
    ref = independent_logprobs(host, two, [a, b])
    np.testing.assert_allclose(ref[len(spec1.prompt_tokens) - 1:].numpy(), together[0].sequences[0].logprobs,
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_stop_strings_and_stop_ids_end_an_image_prompts_rows_as_for_text(hosts, arch):
    host = hosts(arch)
    pic = png(24, 40, 9)
    before = text_ids(host, 4, 10)
    free = host.sample_batch(None, [sample_spec(host, before, [image(pic, 4)], n=1, max_tokens=10,
                                                temperature=0.0)], {})[0].sequences[0]
    assert len(free.tokens) == 10
    stop_id = free.tokens[5]
    cut = free.tokens.index(stop_id) + 1
    by_id = host.sample_batch(None, [sample_spec(host, before, [image(pic, 4)], n=1, max_tokens=10, temperature=0.0,
                                                 stop_token_ids=[stop_id])], {})[0].sequences[0]
    assert by_id.tokens == free.tokens[:cut] and by_id.stop_reason == "stop"
    np.testing.assert_allclose(by_id.logprobs, free.logprobs[:cut], atol=1e-6, rtol=0)
    text = host.tokenizer.decode(free.tokens[6:8])
    if text.strip():
        stopped = host.sample_batch(None, [sample_spec(host, before, [image(pic, 4)], n=1, max_tokens=10,
                                                       temperature=0.0, stop=[text])], {})[0].sequences[0]
        assert stopped.stop_reason == "stop" and len(stopped.tokens) <= 8
        assert text in host.tokenizer.decode(stopped.tokens) and stopped.tokens == free.tokens[:len(stopped.tokens)]


# every loss but those reading the worker's sampling records (stable_reinforce), which image prompts do not keep
TRAINABLE_ON_IMAGES = sorted(name for name, needed in losses.REQUIRED_INPUTS.items()
                             if not any(k in losses.RECORDED_INPUTS for k in needed))


@pytest.mark.parametrize("loss_fn", TRAINABLE_ON_IMAGES)
def test_every_loss_trains_on_an_image_datum_as_on_its_plain_forward(hosts, loss_fn):
    """forward_backward on a datum with an image, each loss: the logprobs equal the independent forward's, the loss
    is the loss of those logprobs, and a gradient accumulates."""
    host = hosts("qwen3_5")
    adapter = host.create_adapter(f"run-loss-{loss_fn}", LoraSpec(rank=4, seed=3))
    pic = png(32, 16, 4)
    before, after = text_ids(host, 4, 6), text_ids(host, 6, 7)
    n_img = host.vision.prepare(_decoded(pic)).n_tokens
    n = len(before) + n_img + len(after)
    rng = np.random.default_rng(0)
    ids = before + [host.vision.image_token_id] * n_img + after
    datum = {"tokens": np.asarray(before + after, np.int64),
             "target_tokens": np.asarray(ids[1:] + [5], np.int64),
             "weights": np.r_[np.zeros(len(before) + n_img), np.ones(len(after))].astype(np.float32),
             "logprobs": rng.normal(-3, 0.1, n).astype(np.float32),
             "advantages": rng.normal(0, 1, n).astype(np.float32),
             "mask": np.r_[np.zeros(len(before) + n_img), np.ones(len(after))].astype(np.float32)}
    needed = losses.REQUIRED_INPUTS[loss_fn] + losses.OPTIONAL_INPUTS[loss_fn]
    datum = {k: v for k, v in datum.items() if k == "tokens" or k in needed and k not in losses.RECORDED_INPUTS}
    rows = validate_rows(loss_fn, [datum], host, LIMITS, [[image(pic, len(before))]])
    assert rows[0]["tokens"].tolist() == ids
    config = losses.resolve_loss_config(loss_fn, {})
    out = host.forward_backward(adapter, rows, loss_fn, config, backward=True)
    ref = independent_logprobs(host, ids + [5], [pic])
    np.testing.assert_allclose(out["outputs"][0]["logprobs"], ref.numpy(), atol=1e-5, rtol=0)
    inputs = {k: torch.from_numpy(v) for k, v in rows[0].items() if k not in ("tokens", "images")}
    expected = losses.compute_loss(loss_fn, ref.float(), inputs, config, None).loss
    assert out["metrics"]["loss_sum"] == pytest.approx(float(expected), abs=1e-5)
    grads = [p.grad for p in adapter.params.values()]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)
    for p in adapter.params.values():
        p.grad = None
    host.drop_adapter(adapter.adapter_id)


def _decoded(data: bytes):
    from server_mock.engine.images import decode_image

    return decode_image(data, "png", LIMITS, "test")


def test_forward_backward_and_optim_step_move_the_weights_and_raise_the_images_completion(hosts):
    host = hosts("gemma3")
    from pytrio_compat.wire import AdamParams

    adapter = host.create_adapter("run-step", LoraSpec(rank=4, seed=1))
    pic = png(30, 30, 5)
    before, after = text_ids(host, 3, 8), text_ids(host, 5, 9)
    n_img = host.vision.prepare(_decoded(pic)).n_tokens
    ids = before + host.vision.prepare(_decoded(pic)).tokens.tolist() + after
    datum = {"tokens": np.asarray(before + after, np.int64), "target_tokens": np.asarray(ids[1:] + [7], np.int64),
             "weights": np.r_[np.zeros(len(before) + n_img), np.ones(len(after))].astype(np.float32)}
    rows = validate_rows("cross_entropy", [datum], host, LIMITS, [[image(pic, len(before))]])
    before_w = {k: v.detach().clone() for k, v in adapter.params.items()}
    first = host.forward_backward(adapter, rows, "cross_entropy", {}, backward=True)
    host.optim_step(adapter, AdamParams(learning_rate=1e-2))
    moved = sum(float((adapter.params[k] - before_w[k]).abs().sum()) for k in before_w)
    assert moved > 0
    second = host.forward_backward(adapter, rows, "cross_entropy", {}, backward=False)
    assert second["metrics"]["loss_sum"] < first["metrics"]["loss_sum"]
    host.drop_adapter(adapter.adapter_id)


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_expected_tokens_checked_and_filled_in(hosts, arch):
    host = hosts(arch)
    pic = png(40, 24, 6)
    count = host.vision.prepare(_decoded(pic)).n_tokens
    spec = sample_spec(host, [5, 6, 7], [image(pic, 1, expected=count)])
    assert len(spec.prompt_tokens) == 3 + count
    assert len(sample_spec(host, [5, 6, 7], [image(pic, 1)]).prompt_tokens) == 3 + count  # filled in
    for wrong in (count - 1, count + 1):
        with pytest.raises(WorkerError) as err:
            sample_spec(host, [5, 6, 7], [image(pic, 1, expected=count), image(pic, 2, expected=wrong)])
        assert err.value.status == 400 and err.value.code == "image_token_mismatch"
        assert err.value.field == "prompt_images[1].chunk.expected_tokens"
        assert f"client counted {wrong} tokens" in err.value.message and f"makes {count}" in err.value.message
    datum = {"tokens": np.asarray([5, 6, 7], np.int64), "target_tokens": np.zeros(3 + count + 1, np.int64)}
    with pytest.raises(WorkerError) as err:
        validate_rows("cross_entropy", [datum], host, LIMITS, [[image(pic, 1, expected=count + 1)]])
    assert err.value.code == "image_token_mismatch" and err.value.field == "data[0].images[0].chunk.expected_tokens"
    with pytest.raises(WorkerError) as err:  # the loss inputs must cover the image's tokens
        validate_rows("cross_entropy", [datum], host, LIMITS, [[image(pic, 1, expected=count)]])
    assert err.value.field == "data[0].loss_fn_inputs.target_tokens" and f"[{3 + count}]" in err.value.message


def test_bad_image_positions_and_placeholders_in_text_are_refused(hosts):
    host = hosts("qwen3_5")
    pic = png(16, 16, 7)
    with pytest.raises(WorkerError) as err:
        sample_spec(host, [5, 6, 7], [image(pic, 4)])
    assert err.value.field == "prompt_images[0].position" and "at most the 3 text tokens" in err.value.message
    sample_spec(host, [5, 6, 7], [image(pic, 3)])  # at the end: the limit itself is fine
    with pytest.raises(WorkerError) as err:
        sample_spec(host, [5, 6, 7], [image(pic, 2), image(pic, 1)])
    assert err.value.field == "prompt_images[1].position" and "reading order" in err.value.message
    with pytest.raises(WorkerError) as err:  # Qwen: adjacent images would make one run of image tokens
        sample_spec(host, [5, 6, 7], [image(pic, 2), image(pic, 2)])
    assert err.value.field == "prompt_images[1].position" and "text between them" in err.value.message
    sample_spec(hosts("gemma3"), [5, 6, 7], [image(pic, 2), image(pic, 2)])  # its images are delimited
    with pytest.raises(WorkerError) as err:
        sample_spec(host, [5, host.vision.image_token_id, 7], [image(pic, 0)])
    assert err.value.field == "prompt_tokens" and "image placeholder" in err.value.message


def test_images_per_request_bound_counts_every_datum(hosts):
    host = hosts("qwen3_5")
    pic = png(16, 16, 8)
    limits = Limits(max_images_per_request=3)
    count = host.vision.prepare(_decoded(pic)).n_tokens

    def datum():
        return {"tokens": np.asarray([5, 6], np.int64), "target_tokens": np.zeros(2 + count, np.int64)}

    validate_rows("cross_entropy", [datum(), datum(), datum()], host, limits, [[image(pic, 1)]] * 3)
    with pytest.raises(WorkerError) as err:
        validate_rows("cross_entropy", [datum()] * 4, host, limits, [[image(pic, 1)]] * 4)
    assert err.value.status == 413 and err.value.code == "too_many_images"
    assert err.value.field == "data[3].images[0].chunk"


def test_text_only_model_refuses_images(tmp_path):
    from server_mock.engine.tiny_model import make_tiny_model

    host = LocalModelHost("text", str(make_tiny_model(tmp_path / "m", seed=0)), "cpu", torch.float32)
    with pytest.raises(WorkerError) as err:
        sample_spec(host, [5, 6], [image(png(16, 16), 1)])
    assert err.value.status == 400 and err.value.field == "prompt_images" and "text-only" in err.value.message


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_an_image_request_joins_a_running_batch_and_gets_what_it_gets_alone(hosts, arch):
    """Continuous admission: a text request decoding, an image request joins it between steps (its rows stacked
    under the running ones), then a text request joins both; each gets the tokens and logprobs it gets alone."""
    host = hosts(arch)
    pic = png(32, 16, 11)
    text1 = sample_spec(host, text_ids(host, 5, 12), None, n=2, max_tokens=12, temperature=0.0)
    pictured = sample_spec(host, text_ids(host, 3, 13) + text_ids(host, 6, 14), [image(pic, 3)], n=3, max_tokens=8,
                           seed=2)
    text2 = sample_spec(host, text_ids(host, 11, 15), None, n=1, max_tokens=5, seed=3)
    session = host.sampling_session(None)
    handles = [session.add(text1)]
    finished = {}
    steps = iter(range(1000))
    for h, res, _ in session.run(lambda: next(steps) >= 2):
        finished[h] = res
    assert session.can_add()
    handles.append(session.add(pictured))
    for h, res, _ in session.run(lambda: next(steps) >= 5):
        finished[h] = res
    handles.append(session.add(text2))
    while session.active:
        for h, res, _ in session.run(lambda: False):
            finished[h] = res
    for spec, h in zip([text1, pictured, text2], handles):
        alone = host.sample_batch(None, [spec], {})[0]
        for x, y in zip(finished[h].sequences, alone.sequences):
            assert x.tokens == y.tokens
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
