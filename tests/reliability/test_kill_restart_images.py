"""kill -9 during a forward_backward on image + text datums (a tiny Qwen3.5 VLM): the journal keeps the datums as
the client sent them, images included, so the restarted worker runs the op again and the run ends bit-identical
to an uninterrupted one."""

from __future__ import annotations

import pytest
from support import WorkerProcess
from vision_support import completion_inputs, pieces, png

import pytrio_compat as trio
from server_mock.engine.tiny_vlm import make_tiny_vlm
from server_mock.storage.checkpoints import CheckpointStore, parse_path

from .kill_helpers import Supervised

pytestmark = pytest.mark.timeout(600)


def image_loop(client: trio.ServiceClient) -> tuple[str, list[float]]:
    """Two steps of forward_backward on two image datums, then optim_step; then save_state."""
    tc = client.create_lora_training_client("vlm", rank=4, seed=3)
    before, after = pieces(tc.get_tokenizer(), "qwen3_5")
    losses = []
    for step in range(2):
        data = []
        for i in range(2):
            completion = [11 + step, 12 + i, 13]
            chunks = [trio.types.EncodedTextChunk(tokens=before), trio.ImageChunk(data=png(32, 32, step * 2 + i),
                                                                                  format="png"),
                      trio.types.EncodedTextChunk(tokens=after + completion[:-1])]
            data.append((chunks, completion))
        # the prompt's length (image tokens included): the worker's own count of the first datum's prompt
        sampler = tc.save_weights_and_get_sampling_client()
        counted = sampler.sample(trio.ModelInput(chunks=data[0][0][:2] + [trio.types.EncodedTextChunk(tokens=after)]),
                                 num_samples=1, sampling_params=trio.SamplingParams(max_tokens=1, seed=1)).result()
        n_prompt = counted.input_tokens
        datums = [trio.Datum(model_input=trio.ModelInput(chunks=chunks),
                             loss_fn_inputs=completion_inputs(n_prompt, completion)) for chunks, completion in data]
        out = tc.forward_backward(datums, "cross_entropy").result()
        losses.append(out.metrics["loss_sum"])
        tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    return tc.save_state("final").result().path, losses


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return make_tiny_vlm(tmp_path_factory.mktemp("kill-vlm") / "qwen3_5", arch="qwen3_5", seed=2)


def test_kill_during_an_image_forward_backward_loses_nothing(vlm_dir, tmp_path, fast_retries, client_cache):
    reference = WorkerProcess(vlm_dir, tmp_path / "reference", model_name="vlm").start()
    client = trio.ServiceClient(base_url=reference.base_url)
    try:
        path, losses = image_loop(client)
        expected = CheckpointStore(tmp_path / "reference").fingerprint(parse_path(path))
    finally:
        client.close()
        reference.stop()

    supervised = Supervised(vlm_dir, tmp_path / "killed", crash_at="forward_backward:2", model_name="vlm")
    client = trio.ServiceClient(base_url=supervised.base_url)
    try:
        path, killed_losses = image_loop(client)
        assert supervised.restarts == 1
    finally:
        client.close()
        supervised.stop()
    assert killed_losses == losses
    assert CheckpointStore(tmp_path / "killed").fingerprint(parse_path(path)) == expected
