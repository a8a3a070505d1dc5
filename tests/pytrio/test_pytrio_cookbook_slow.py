"""One step of each pytrio-cookbook 0.1.0 trainer (GRPO, SFT, DPO, OPD), unmodified, against a real worker on a tiny
model. The cookbook is installed without its pins (scripts/setup_env.sh); its code runs on Python 3.11."""

from __future__ import annotations

import importlib.util
import math

import pytest
from pytrio_support import KEY_A, run_sdk

import pytrio_compat as ours

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cookbook_worker(tiny_model_dir, tmp_path_factory):
    """The tiny model as ``tiny``, and another random one with the same tokenizer as the OPD teacher."""
    from support import WorkerProcess

    from server_mock.engine.tiny_model import make_tiny_model

    teacher = make_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1)
    root = tmp_path_factory.mktemp("pytrio-cookbook")
    proc = WorkerProcess(tiny_model_dir, root / "storage", "--model", f"teacher={teacher}", api_keys=[KEY_A]).start()
    yield proc
    proc.stop()


def test_one_step_of_each_cookbook_trainer(cookbook_worker, tmp_path):
    if importlib.util.find_spec("trio_cookbook") is None:  # a failure instead under PYTRIO_REQUIRE_EXTRAS=1
        pytest.skip("pytrio-cookbook is not installed (scripts/setup_env.sh installs it)")
    report = run_sdk(cookbook_worker, KEY_A, "cookbook_steps", {"model": "tiny", "teacher": "teacher"}, tmp_path,
                     timeout=900)
    grpo, sft, dpo, opd = report["grpo"]["metrics"], report["sft"]["metrics"], report["dpo"]["metrics"], \
        report["opd"]["metrics"]
    # GRPO: 2 prompts x 4 samples of 8 tokens, its importance_sampling step moved the weights
    assert grpo["rollout/completion_length_max"] == 8 and grpo["optim/grad_norm"] > 0
    assert grpo["token_count"] == grpo["train/input_tokens"]  # its prompt targets are 0, not -100: all count
    # SFT: the per-token cross-entropy of a random model is about ln(vocabulary)
    assert sft["train/loss"] == pytest.approx(math.log(512), abs=0.5) and sft["grad_norm"] > 0
    assert sft["token_count"] == sft["train/tokens"]
    # DPO: policy == reference at the first step, so the loss is ln 2 and the margins 0
    assert dpo["train/loss"] == pytest.approx(math.log(2), abs=1e-5) and dpo["rewards/margins"] == 0
    assert dpo["grad_norm"] > 0
    # OPD: a different teacher gives a non-zero reverse KL and a gradient
    assert opd["distill/reverse_kl_sampled"] != 0 and opd["optim/grad_norm"] > 0
    assert opd["data/completions"] == 2
    client = ours.ServiceClient(base_url=cookbook_worker.base_url, api_key=KEY_A)
    try:
        kinds = {c.checkpoint_type for c in client.create_rest_client().list_user_checkpoints().result().checkpoints}
    finally:
        client.close()
    assert "training" in kinds  # GRPO's save_every=1 saved its state
