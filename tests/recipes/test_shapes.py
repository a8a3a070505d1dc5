"""The `--dataset shapes` task (recipes/shapes.py): its pictures hold what their answers say (counted here from the
pixels), the splits are disjoint, the image prompt renders around the family's marker, and both demos run the
Vision GRPO path end to end on a worker serving a tiny random Qwen3.5 VLM (sampling on an image prompt, datums with
the image counted, forward_backward, optim_step)."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import pytrio_compat as trio

pytestmark = pytest.mark.timeout(600)
RECIPES = str(Path(__file__).resolve().parents[2] / "recipes")


@pytest.fixture(autouse=True)
def _recipes_path(monkeypatch):
    monkeypatch.syspath_prepend(RECIPES)


def colours_in_cells(png: bytes) -> list[str]:
    """The colour of each shape, read from the pixels: one shape per occupied cell of the 3x3 grid."""
    from shapes import COLOURS

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    found = []
    for x in range(3):
        for y in range(3):
            cell = pixels[y * 21:y * 21 + 21, x * 21:x * 21 + 21].reshape(-1, 3)
            ink = cell[np.abs(cell - [245, 245, 240]).sum(-1) > 60]
            if len(ink) < 10:
                continue
            mean = ink.mean(0)
            found.append(min(COLOURS, key=lambda c: np.abs(mean - COLOURS[c]).sum()))
    return found


def test_every_answer_is_the_count_in_its_picture():
    from shapes import shapes_rows

    rows = shapes_rows("train", seed=1, n=60)
    counts = set()
    for row in rows:
        colours = colours_in_cells(row["image"])
        asked = re.match(r"How many (?:(\w+) )?shapes", row["question"]).group(1)
        want = len(colours) if asked is None else colours.count(asked)
        assert row["answer"] == f"#### {want}", row["question"]
        counts.add(want)
    assert counts >= {1, 2, 3}  # the task is not one answer
    test = shapes_rows("test", seed=1, n=60)
    assert not {r["image"] for r in rows} & {r["image"] for r in test}
    assert [r["image"] for r in shapes_rows("train", seed=1, n=5)] == [r["image"] for r in rows[:5]]
    with pytest.raises(ValueError, match="splits"):
        shapes_rows("validation")


@pytest.fixture(scope="module")
def vlm_worker(tmp_path_factory):
    from support import WorkerProcess

    from server_mock.engine.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("shapes")
    folder = make_tiny_vlm(root / "qwen3_5", arch="qwen3_5", seed=4)
    proc = WorkerProcess(folder, root / "storage", model_name="tiny-vlm").start()
    yield proc, folder
    proc.stop()


def test_image_prompt_keeps_the_template_text_around_the_marker(vlm_worker):
    from shapes import SHAPES_FEWSHOT, counted, render_image_prompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vlm_worker[1])
    png = Image.new("RGB", (8, 8)).tobytes()
    prompt = render_image_prompt(tok, "How many shapes?", png, SHAPES_FEWSHOT, " Box it.")
    before, image, after = prompt.chunks
    assert isinstance(image, trio.ImageChunk) and image.expected_tokens is None
    assert tok.decode(before.tokens).endswith("<|im_start|>user\n<|vision_start|>")
    assert tok.decode(after.tokens).startswith("<|vision_end|>How many shapes? Box it.<|im_end|>")
    text_len = len(before.tokens) + len(after.tokens)
    assert counted(prompt, text_len + 12).chunks[1].expected_tokens == 12
    assert counted(prompt, text_len + 12).length == text_len + 12


@pytest.mark.parametrize("script", ["01-demo-sync.py", "02-demo-async.py"])
def test_demo_runs_the_vision_grpo_path_against_a_worker(vlm_worker, script, load_demo, tmp_path, monkeypatch):
    proc, _ = vlm_worker
    demo = load_demo(script)
    calls = []

    def alternating_reward(text, answer):  # a random tiny model never counts right: every group mixed
        calls.append(text)
        return float(len(calls) % 2)

    monkeypatch.setattr(demo, "grade", alternating_reward)
    summary = demo.main([
        "--base-url", proc.base_url, "--base-model", "tiny-vlm", "--dataset", "shapes", "--steps", "2",
        "--batch-size", "2", "--group-size", "4", "--max-tokens", "6", "--lora-rank", "4",
        "--learning-rate", "1e-3", "--loss-fn", "importance_sampling", "--seed", "3",
        "--log-dir", str(tmp_path / "run"), "--eval-every", "2", "--eval-size", "2",
    ])
    history = summary["history"]
    assert len(calls) == 2 * 2 * 4
    for row in history[:2]:
        assert row["datums"] == 8 and row["train_tokens"] > 0 and math.isfinite(row["loss_mean"])
        assert abs(row["kl_sample_train"]) < 1e-5  # the sampler's logprobs on the image prompt are the trainer's
    assert "eval/accuracy" in history[2]
    datum = summary["first_step_datums"][0]
    text, images = datum.model_input.text_and_images()
    assert len(images) == 1 and images[0][1].expected_tokens > 0
    n = datum.model_input.length
    assert n == len(text) + images[0][1].expected_tokens
    assert all(len(t.data) == n for t in datum.loss_fn_inputs.values())
