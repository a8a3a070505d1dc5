"""Time of one GRPO group step with an image prompt, against the same step on a text prompt of the same length, on
tiny random VLMs (engine/tiny_vlm.py) in this process: sample a group (one prefill, the vision encoder once),
forward_backward on the group's datums (importance_sampling; full passes, each datum with its image), optim_step.

The text step's prompt has as many tokens as the image prompt expanded (its image's tokens replaced by text ids),
so the ratio is what the images cost: decoding and processing them (on the request's thread), the vision tower in
the prefill and in every datum's forward/backward, and the training passes prefix sharing cannot shorten.

    python benchmarks/vision_step.py [--families qwen3_5,gemma3] [--group 8] [--max-tokens 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import median, save  # noqa: E402


def png(width: int, height: int, seed: int = 0) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def group_step(host, adapter, prompt: list[int], images, args, limits) -> dict[str, float]:
    """One group step's phases in seconds: checking the request (images decoded there), sampling, training."""
    from pytrio_compat.wire import AdamParams, SampleRequest, WireSamplingParams
    from server_mock.service.validation import validate_rows, validate_sample

    times = {}
    t0 = time.perf_counter()
    request = SampleRequest(prompt_tokens=prompt, prompt_images=images, num_samples=args.group,
                            sampling_params=WireSamplingParams(max_tokens=args.max_tokens, seed=1, stop_token_ids=[]))
    spec = validate_sample(request, host, limits)
    t1 = time.perf_counter()
    result = host.sample_batch(host.snapshot(adapter), [spec], {})[0]
    t2 = time.perf_counter()
    n = len(spec.prompt_tokens)
    rng = np.random.default_rng(0)
    data = []
    for seq in result.sequences:
        m = n + len(seq.tokens) - 1
        data.append({"tokens": np.asarray(prompt + seq.tokens[:-1], np.int64),
                     "target_tokens": np.asarray([0] * (n - 1) + seq.tokens, np.int64),
                     "logprobs": np.asarray([0.0] * (n - 1) + seq.logprobs, np.float32),
                     "advantages": np.r_[np.zeros(n - 1), np.full(len(seq.tokens), rng.normal())].astype(np.float32)})
        assert len(data[-1]["target_tokens"]) == (m if images else len(data[-1]["tokens"]))
    rows = validate_rows("importance_sampling", data, host, limits, [images] * len(data) if images else None)
    host.forward_backward(adapter, rows, "importance_sampling", {}, backward=True)
    host.optim_step(adapter, AdamParams(learning_rate=1e-4))
    t3 = time.perf_counter()
    times.update({"check": t1 - t0, "sample": t2 - t1, "train": t3 - t2, "step": t3 - t0})
    return times


def main(argv=None) -> dict:
    import torch

    from pytrio_compat.types.model_input import ImageChunk
    from pytrio_compat.wire import LoraSpec, WireImage
    from server_mock.config import Limits
    from server_mock.engine.images import decode_image
    from server_mock.engine.local_host import LocalModelHost
    from server_mock.engine.tiny_vlm import make_tiny_vlm

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="qwen3_5,gemma3")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", default="64x64", help="the image's WIDTHxHEIGHT")
    args = parser.parse_args(argv)
    width, height = (int(x) for x in args.size.split("x"))
    limits = Limits()
    picture = png(width, height)
    out: dict = {"group": args.group, "max_tokens": args.max_tokens, "image": args.size, "families": {}}
    root = Path(tempfile.mkdtemp())
    for family in args.families.split(","):
        host = LocalModelHost(family, str(make_tiny_vlm(root / family, arch=family, seed=0)), "cpu", torch.float32)
        adapter = host.create_adapter(f"run-{family}", LoraSpec(rank=16, seed=0))
        before = np.random.default_rng(1).integers(3, 500, 40).tolist()
        after = np.random.default_rng(2).integers(3, 500, 20).tolist()
        images = [WireImage(position=len(before), chunk=ImageChunk(data=picture, format="png"))]
        n_image = host.vision.prepare(decode_image(picture, "png", limits, "bench")).n_tokens
        text_prompt = before + np.random.default_rng(3).integers(3, 500, n_image).tolist() + after
        runs = {"image": [], "text": []}
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            runs["image"].append(group_step(host, adapter, before + after, images, args, limits))
            runs["text"].append(group_step(host, adapter, text_prompt, None, args, limits))
        stats = {kind: {k: median([r[k] for r in rs[1:]]) for k in rs[0]} for kind, rs in runs.items()}
        out["families"][family] = {"image_tokens": n_image, "prompt_tokens": len(text_prompt), **stats,
                                   "ratio_image_to_text": stats["image"]["step"] / stats["text"]["step"]}
    save("vision_step", out)
    return out


if __name__ == "__main__":
    main()
