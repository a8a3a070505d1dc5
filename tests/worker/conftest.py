"""The engine tests' fixtures: the session's tiny tokenizer under its short name, tiny random vision-language
models on disk, one per family, shared by the engine's image tests, and a guard that no image's pixels are
decoded."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok(tiny_tokenizer):
    """``tiny_tokenizer`` (tests/conftest.py), as the engine tests call it."""
    return tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """``tiny_vlm_dir(arch)``: the folder of a tiny VLM of ``arch`` (seed 0), written once per session."""
    from server_mock.engine.tiny_vlm import make_tiny_vlm

    root = tmp_path_factory.mktemp("tiny-vlms")
    made: dict[str, object] = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = make_tiny_vlm(root / arch, arch=arch, seed=0)
        return made[arch]

    return get


@pytest.fixture()
def no_decoding(monkeypatch):
    """Fails the test if Pillow decodes any pixel data; the sizes of the images it was asked to decode."""
    from PIL import ImageFile

    calls = []

    def load(self):
        calls.append(self.size)
        raise AssertionError(f"pixels of a {self.size} image were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls
