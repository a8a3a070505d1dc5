"""The PyTRIO course's Vision GRPO calls through the official ``pytrio`` SDK, on a tiny random Qwen3.5 VLM served by
the real HTTP worker: a group sampled from an image + text ``ModelInput`` (its ``input_tokens`` the client's count),
forward on image + text datums (the sampler's logprobs equal the trainer's), forward_backward + optim_step moving
the weights, and a wrong ``expected_tokens`` refused naming both counts (scripts/vision_flow.py)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from pytrio_support import KEY_A, run_sdk
from vision_support import image_tokens, pieces, png

from server_mock.engine.tiny_vlm import make_tiny_vlm

pytestmark = pytest.mark.timeout(600)
pytest.importorskip("pytrio")
TOL = 1e-5


@pytest.fixture(scope="module")
def vlm_worker(tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("pytrio-vlm")
    folder = make_tiny_vlm(root / "qwen3_5", arch="qwen3_5", seed=2)
    proc = InProcessWorker(folder, root / "storage", api_keys=[KEY_A], model_name="qwen3_5").start()
    yield proc, folder
    proc.stop()


def test_pytrio_sdk_runs_the_vision_grpo_calls(vlm_worker, tmp_path):
    from transformers import AutoTokenizer

    proc, folder = vlm_worker
    tok = AutoTokenizer.from_pretrained(folder)
    before, after = pieces(tok, "qwen3_5")
    data_png = png(48, 32, 3)
    count = image_tokens(folder, data_png)
    plan = {"model": "qwen3_5", "before": before, "after": after, "expected_tokens": count,
            "image": base64.b64encode(data_png).decode()}
    report = run_sdk(proc, KEY_A, "vision_flow", plan, tmp_path / "sdk")
    n = len(before) + count + len(after)
    assert report["input_tokens"] in (None, n)
    assert len(report["sequences"]) == 4
    for seq, trained in zip(report["sequences"], report["trainer"]):
        assert float(np.abs(np.asarray(trained) - np.asarray(seq["logprobs"])).max()) <= TOL
    assert float(np.abs(np.asarray(report["after"]) - np.asarray(report["trainer"][0])).max()) > 1e-4
    assert report["mismatch"] is not None and f"makes {count}" in report["mismatch"]
