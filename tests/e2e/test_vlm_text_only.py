"""Vision-language models served by the real HTTP worker answer text-only requests exactly as a text model does:
group sampling, early stops, coalesced prompts, sampler-vs-trainer logprobs and a training step (the text family
matrix's checks, ``test_model_families.check_family``), on tiny random VLMs loaded with their image-text class."""

from __future__ import annotations

import pytest
from test_model_families import check_family

import pytrio_compat as trio
from server_mock.engine.tiny_vlm import TINY_VLM_FAMILIES, make_tiny_vlm

pytestmark = pytest.mark.timeout(600)
FAMILIES = list(TINY_VLM_FAMILIES)


@pytest.fixture(scope="module")
def vlm_service(tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("vlms")
    dirs = {f: make_tiny_vlm(root / f, arch=f, seed=1) for f in FAMILIES}
    extra = [arg for f in FAMILIES[1:] for arg in ("--model", f"{f}={dirs[f]}")]
    proc = InProcessWorker(dirs[FAMILIES[0]], root / "storage", *extra, "--log-level", "INFO",
                           model_name=FAMILIES[0]).start()
    client = trio.ServiceClient(base_url=proc.base_url)
    yield client, proc
    client.close()
    proc.stop()


@pytest.mark.parametrize("family", FAMILIES)
def test_vlm_answers_text_as_a_text_model(vlm_service, family):
    check_family(vlm_service[0], family)


def test_vlms_load_as_image_text_models_and_take_every_fast_path(vlm_service):
    client, proc = vlm_service
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as CLASSES

    for family in FAMILIES:  # a run on each loads it; its tokenizer has the image tokens
        tok = client.create_lora_training_client(family, rank=4, seed=0).get_tokenizer()
        assert len(tok) > 512
    log = (proc.storage.parent / "worker.log").read_text()
    for family in FAMILIES:
        assert f"model type {family}: an image-text model ({CLASSES[family]}); images are taken" in log
    assert "cannot be expanded" not in log and "cannot be left-padded" not in log
    assert "image inputs are refused" not in log and "does not share prompt prefixes" not in log
