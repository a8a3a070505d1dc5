"""The `--dataset shapes` task: count the coloured shapes in a small generated picture (the Vision GRPO path).

Each row is a 64x64 PNG drawn with Pillow: 1 to 5 shapes (circles, squares, triangles) in one of four colours on
a light background, and the question "How many <colour> shapes are in the picture?" (or "How many shapes ..."),
whose answer is a count, graded as a boxed number like the arithmetic task. The pictures are generated from the
seed, so the task needs no download and a tiny VLM can run it on a CPU.

The prompt is an image + text `ModelInput`: the chat template renders the user turn with an image part, and the
model's image marker in the rendered text becomes the `ImageChunk` (its `expected_tokens` left to the worker, which
fills it in; the sample response's `input_tokens` gives it back, and `counted` puts it on the prompt the datums
are built from).
"""

from __future__ import annotations

import io
import random
import zlib
from typing import Any

import pytrio_compat as trio

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
KINDS = ("circle", "square", "triangle")
SIZE = 64
# the text each family's chat template puts where an image goes (Qwen keeps <|vision_start|>/<|vision_end|> as text)
IMAGE_MARKERS = ("<|image_pad|>", "<start_of_image>", "<image>")
SHAPES_FEWSHOT: list[dict[str, str]] = [
    {"role": "user", "content": "How many letters are in the word 'cat'? Provide a numerical answer without "
                                "units, written inside \\boxed{}."},
    {"role": "assistant", "content": "c, a, t: three letters. \\boxed{3}"},
]


def draw_shapes(seed: int) -> tuple[bytes, list[tuple[str, str]]]:
    """A PNG of 1-5 non-overlapping shapes and their (colour, kind), drawn from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    draw = ImageDraw.Draw(img)
    cells = rng.sample([(x, y) for x in range(3) for y in range(3)], rng.randint(1, 5))  # a 3x3 grid: no overlap
    shapes = []
    for x, y in cells:
        colour, kind = rng.choice(list(COLOURS)), rng.choice(KINDS)
        left, top = x * 21 + 3, y * 21 + 3
        box = (left, top, left + 15, top + 15)
        if kind == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        elif kind == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        else:
            draw.polygon([(left + 7, top), (left, top + 15), (left + 15, top + 15)], fill=COLOURS[colour])
        shapes.append((colour, kind))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue(), shapes


def shapes_rows(split: str, seed: int = 0, n: int | None = None) -> list[dict]:
    """Rows ``{"question", "answer", "image"}`` (answer ``"#### N"``). The train and test pictures come from
    disjoint seed ranges, so the splits never share a picture."""
    if split not in ("train", "test"):
        raise ValueError(f"shapes has splits 'train' and 'test', not {split!r}")
    count = n if n is not None else (512 if split == "train" else 64)
    base = zlib.crc32(f"shapes:{split}:{seed}".encode()) % (1 << 20) * 4096 + (0 if split == "train" else 1 << 40)
    rows = []
    for i in range(count):
        image, shapes = draw_shapes(base + i)
        rng = random.Random(base + i + 7)
        colour = rng.choice([None, *sorted({c for c, _ in shapes})])
        if colour is None:
            question, answer = "How many shapes are in the picture?", len(shapes)
        else:
            question, answer = (f"How many {colour} shapes are in the picture?",
                                sum(1 for c, _ in shapes if c == colour))
        rows.append({"question": question, "answer": f"#### {answer}", "image": image})
    return rows


def render_image_prompt(tokenizer: Any, question: str, image: bytes, fewshot, suffix: str) -> trio.ModelInput:
    """The few-shot turns, then a user turn with the picture and the question, as an image + text `ModelInput`."""
    messages = [*fewshot, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question + suffix}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    marker = next((m for m in IMAGE_MARKERS if m in text), None)
    if marker is None:
        raise ValueError("the tokenizer's chat template has no image marker: use a vision-language model")
    before, after = text.split(marker, 1)
    return trio.ModelInput(chunks=[
        trio.types.EncodedTextChunk(tokens=tokenizer.encode(before, add_special_tokens=False)),
        trio.ImageChunk(data=image, format="png"),
        trio.types.EncodedTextChunk(tokens=tokenizer.encode(after, add_special_tokens=False)),
    ])


def counted(prompt: trio.ModelInput, input_tokens: int) -> trio.ModelInput:
    """``prompt`` with its one image's ``expected_tokens`` set from the worker's count of the whole prompt."""
    text, images = prompt.text_and_images()
    if len(images) != 1 or images[0][1].expected_tokens is not None:
        return prompt
    chunks = [c.model_copy(update={"expected_tokens": input_tokens - len(text)}) if isinstance(c, trio.ImageChunk)
              else c for c in prompt.chunks]
    return trio.ModelInput(chunks=chunks)
