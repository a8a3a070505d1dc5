"""What an image becomes for each tiny VLM family (engine/vision.py): its token count checked against independent
counts (the client-side count Tinker's renderers use, the family's own processor on a whole prompt, the rows of
the vision tower's output), the ``expected_tokens`` check, and the probe (engine/vision_probe.py): a prompt with an
image prefilled into the KV cache and decoded as text gives a full forward pass's logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server_mock.engine.images import DecodedImage
from server_mock.engine.loading import load_model_and_tokenizer
from server_mock.engine.tiny_vlm import TINY_VLM_FAMILIES
from server_mock.engine.vision import ImageProcessing, check_expected_tokens, load_image_processing
from server_mock.engine.vision_probe import image_logits, probe_image, probe_image_decoding
from server_mock.errors import WorkerError

pytestmark = pytest.mark.timeout(300)
QWEN = ("qwen3_5", "qwen3_vl", "qwen2_5_vl")
SIZES = [(64, 48), (17, 9), (300, 200), (33, 65), (16, 16)]  # (width, height): tiny, over max_pixels, odd


@pytest.fixture(scope="module")
def loaded(tiny_vlm_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            model, tok, source = load_model_and_tokenizer(str(tiny_vlm_dir(arch)), "cpu", torch.float32)
            cache[arch] = model, tok, load_image_processing(model, source, tok)
        return cache[arch]

    return get


def picture(width: int, height: int, seed: int = 0) -> DecodedImage:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return DecodedImage(f"img-{width}x{height}-{seed}", Image.fromarray(pixels, "RGB"), width, height)


def feature_rows(model, vision: ImageProcessing, prepared) -> int:
    pixels = {k: torch.from_numpy(v) for k, v in prepared.pixel_inputs.items()}
    with torch.no_grad():
        out = model.get_image_features(**pixels, return_dict=True).pooler_output
    if isinstance(out, (list, tuple)):
        return sum(int(t.reshape(-1, t.shape[-1]).shape[0]) for t in out)
    return int(out.reshape(-1, out.shape[-1]).shape[0])


@pytest.mark.parametrize("arch", QWEN)
@pytest.mark.parametrize("size", SIZES)
def test_qwen_image_tokens_are_the_clients_patch_count_and_the_vision_towers_rows(loaded, arch, size):
    model, tok, vision = loaded(arch)
    width, height = size
    prepared = vision.prepare(picture(width, height))
    proc = vision.image_processor
    # how a Tinker renderer counts an image's tokens client side, from its size alone
    client = proc.get_number_of_image_patches(height, width, {}) // proc.merge_size ** 2
    assert prepared.n_tokens == prepared.placeholders == client
    assert set(prepared.tokens.tolist()) == {tok.convert_tokens_to_ids("<|image_pad|>")}
    assert feature_rows(model, vision, prepared) == prepared.placeholders
    assert all(isinstance(v, np.ndarray) for v in prepared.pixel_inputs.values())
    assert set(prepared.pixel_inputs) == {"pixel_values", "image_grid_thw"}


@pytest.mark.parametrize("arch", ["gemma3", "llava"])
@pytest.mark.parametrize("size", SIZES[:3])
def test_processor_families_expand_an_image_as_their_processor_does_inside_a_prompt(loaded, arch, size):
    model, tok, vision = loaded(arch)
    image = picture(*size)
    prepared = vision.prepare(image)
    marker = vision.processor.image_token
    text = "what is 12 + 30? " + marker + " the answer is"
    whole = vision.processor(text=[text], images=[[image.image]], return_tensors="np",
                             add_special_tokens=False)["input_ids"][0].tolist()
    before = tok.encode("what is 12 + 30? ", add_special_tokens=False)
    after = tok.encode(" the answer is", add_special_tokens=False)
    assert whole == before + prepared.tokens.tolist() + after
    assert feature_rows(model, vision, prepared) == prepared.placeholders
    expected = model.config.mm_tokens_per_image if arch == "gemma3" else (32 // 8) ** 2  # LLaVA: one per patch
    assert prepared.placeholders == expected


def test_expected_tokens_filled_in_matched_or_a_400_naming_the_chunk_and_both_numbers(loaded):
    _, _, vision = loaded("qwen3_5")
    prepared = vision.prepare(picture(64, 48))
    n = prepared.n_tokens
    assert check_expected_tokens(prepared, None, "prompt.chunks[1]") == n
    assert check_expected_tokens(prepared, n, "prompt.chunks[1]") == n
    for wrong in (n + 1, n - 1):
        with pytest.raises(WorkerError) as info:
            check_expected_tokens(prepared, wrong, "data[3].model_input.chunks[2]")
        err = info.value
        assert (err.status, err.code, err.field) == (400, "image_token_mismatch",
                                                     "data[3].model_input.chunks[2].expected_tokens")
        assert f"counted {wrong} tokens" in err.message and f"makes {n}" in err.message and "64x48" in err.message


def test_forward_inputs_refuse_a_batch_whose_image_tokens_do_not_match_its_images(loaded):
    _, _, vision = loaded("qwen3_5")
    prepared = vision.prepare(picture(64, 48))
    ids = torch.tensor([[5, 6] + prepared.tokens.tolist()[:-1] + [7]])
    with pytest.raises(ValueError):
        vision.forward_inputs(ids, [prepared], "cpu")
    good = torch.tensor([[5, 6] + prepared.tokens.tolist() + [7]])
    inputs = vision.forward_inputs(good, [prepared], "cpu")
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0] + [1] * prepared.n_tokens + [0]]
    two = vision.forward_inputs(torch.cat([good, good]), [prepared, prepared], "cpu")
    assert two["pixel_values"].shape[0] == 2 * prepared.pixel_inputs["pixel_values"].shape[0]


def _token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("arch", TINY_VLM_FAMILIES)
def test_text_after_an_image_decoded_from_the_cache_has_the_full_passes_logprobs(loaded, arch):
    model, tok, vision = loaded(arch)
    assert probe_image_decoding(model, vision, len(tok)) is None
    with torch.no_grad():
        run, prompt_len = image_logits(model, vision, len(tok), "cpu")
        full, cached, pre = run.full(), run.cached(prompt_len), run.precomputed()
        follow = run.ids[0, prompt_len:]
        want = _token_logprobs(full[prompt_len - 1:-1], follow)
        got = _token_logprobs(cached[:-1], follow)
        assert float((got - want).abs().max()) <= 1e-5
        assert float((torch.log_softmax(pre, -1) - torch.log_softmax(full, -1)).abs().max()) <= 1e-6
        # not vacuous: another image changes the logprobs of the text after it
        other = ImageLogitsWith(model, vision, run, picture(64, 48, seed=7))
        assert float((torch.log_softmax(other, -1) - torch.log_softmax(full, -1))[prompt_len - 1:].abs().max()) > 1e-4
    assert all(getattr(m, "rope_deltas", None) is None for m in model.modules())


def ImageLogitsWith(model, vision, run, image: DecodedImage) -> torch.Tensor:  # noqa: N802 - reads as a value
    """The full pass's logits of ``run``'s sequence with its image swapped for ``image`` (same size)."""
    from server_mock.engine.vision_probe import ImageLogits

    prepared = vision.prepare(image)
    assert prepared.n_tokens == run.images[0].n_tokens
    return ImageLogits(model, vision, run.ids[0].tolist(), [prepared], "cpu").full()


def test_the_probe_catches_text_decoded_at_plain_positions_after_an_image(loaded, monkeypatch):
    """Qwen lays the tokens after an image out at M-RoPE positions; decoded at plain positions (what happens if
    the offsets transformers caches on the model are lost between calls) they get other logprobs."""
    model, tok, vision = loaded("qwen3_5")
    monkeypatch.setattr(vision, "positions", lambda *a, **k: (None, None))
    forget = model.register_forward_pre_hook(lambda module, args: setattr(module.model, "rope_deltas", None))
    try:
        why = probe_image_decoding(model, vision, len(tok))
    finally:
        forget.remove()
    assert why is not None and "differs from a full forward pass" in why


def test_the_probe_reports_a_forward_that_fails_on_an_image(loaded, monkeypatch):
    model, tok, vision = loaded("llava")
    real = vision.prepare

    def short(image):  # one placeholder too few for the vision tower's features
        prepared = real(image)
        return type(prepared)(prepared.digest, prepared.width, prepared.height, prepared.tokens[:-1],
                              prepared.placeholders - 1, prepared.pixel_inputs)

    monkeypatch.setattr(vision, "prepare", short)
    why = probe_image_decoding(model, vision, len(tok))
    assert why is not None and why.startswith("a forward pass with an image failed")


def test_probe_image_is_deterministic_rgb_with_structure():
    a, b = probe_image(), probe_image()
    assert a.image.mode == "RGB" and a.image.size == (64, 48)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image))
    assert np.asarray(a.image).std() > 20
