"""Decoding from a snapshot with its LoRA merged into a weight copy: the unmerged path's tokens, logprobs equal to
the trainer's, the base model untouched (also when a forward fails), the byte budget at its edge, bf16 never."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pytrio_compat.wire import LoraSpec
from server_mock.config import TrainOptions
from server_mock.engine.local_host import LocalModelHost
from server_mock.engine.merged_lora import MergedDecoder, merged_bytes
from server_mock.sampling.generate import SampleSpec, generate_batch, teacher_forced_logprobs


def _host(model_dir, dtype=torch.float32, **options) -> LocalModelHost:
    return LocalModelHost("tiny", str(model_dir), "cpu", dtype, options=TrainOptions(**options))


def _trained(host: LocalModelHost, name: str, seed: int):
    adapter = host.create_adapter(name, LoraSpec(rank=4, seed=seed))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a LoRA the size a few optimizer steps give
        for pname, p in adapter.params.items():
            if "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return adapter, host.snapshot(adapter)


SPEC = SampleSpec(prompt_tokens=[5, 6, 7, 8, 9], num_samples=4, max_tokens=12, seed=3, stop_token_ids=[])


def test_merged_decoding_matches_the_unmerged_path_and_the_trainer(tiny_model_dir):
    host = _host(tiny_model_dir)
    adapter, snapshot = _trained(host, "run-a", 1)
    merged = host.decode_model(snapshot)
    assert isinstance(merged, MergedDecoder)
    got = generate_batch(merged, [SPEC], host.tokenizer)[0]
    unmerged = generate_batch(host.sampling_model(snapshot), [SPEC], host.tokenizer)[0]
    assert [s.tokens for s in got.sequences] == [s.tokens for s in unmerged.sequences]
    host._activate(adapter)  # the trainer's view: the run's own adapter, unmerged
    for seq in got.sequences:
        ref = teacher_forced_logprobs(host.peft, SPEC.prompt_tokens + seq.tokens)[len(SPEC.prompt_tokens) - 1:]
        assert np.abs(np.asarray(ref) - np.asarray(seq.logprobs)).max() < 1e-5
    # the merge changed the numbers (it is the adapter's model, not the base model's)
    base = generate_batch(host.sampling_model(None), [SPEC], host.tokenizer)[0]
    assert max(abs(a - b) for x, y in zip(got.sequences, base.sequences)
               for a, b in zip(x.logprobs, y.logprobs)) > 1e-3


def test_the_base_model_is_left_as_it_was_even_when_a_forward_fails(tiny_model_dir):
    host = _host(tiny_model_dir)
    _, snapshot = _trained(host, "run-a", 1)
    merged = host.decode_model(snapshot)  # (this adds the sampler slot's LoRA layers to the model)
    before = {name: module for name, module in host.model.named_modules()}
    weights = {name: p.detach().clone() for name, p in host.model.named_parameters()}
    with torch.no_grad():
        merged(input_ids=torch.tensor([[5, 6, 7]]))
        with pytest.raises(IndexError):
            merged(input_ids=torch.tensor([[5, 6, 10 ** 6]]))  # an id past the vocabulary fails mid-forward
    assert {name: module for name, module in host.model.named_modules()} == before
    assert all(torch.equal(p, weights[name]) for name, p in host.model.named_parameters())
    head = host.model.get_output_embeddings()
    assert head.base_layer.weight is host.model.get_input_embeddings().weight  # still tied


def test_the_byte_budget_at_its_edge_and_least_recently_used_first(tiny_model_dir):
    probe = _host(tiny_model_dir)
    _, snapshot = _trained(probe, "run-a", 1)
    probe.decode_model(snapshot)  # loads the sampler slot the merge reads
    size = merged_bytes(probe.peft, probe._slot_name(snapshot))
    layers = [m for m in probe.model.modules() if hasattr(m, "lora_A") and probe._slot_name(snapshot) in m.lora_A]
    assert size == sum(m.base_layer.weight.numel() * 4 for m in layers) > 0
    exact = _host(tiny_model_dir, merge_lora_bytes=size)
    _, snap_a = _trained(exact, "run-a", 1)
    _, snap_b = _trained(exact, "run-b", 2)
    merged_a = exact.decode_model(snap_a)
    assert isinstance(merged_a, MergedDecoder) and exact.decode_model(snap_a) is merged_a  # kept
    assert isinstance(exact.decode_model(snap_b), MergedDecoder)  # room for one: a's copy is dropped
    assert list(exact._merged) == [snap_b.snapshot_id]
    short = _host(tiny_model_dir, merge_lora_bytes=size - 1)
    _, snap = _trained(short, "run-a", 1)
    assert not isinstance(short.decode_model(snap), MergedDecoder) and short._merged == {}
    off = _host(tiny_model_dir, merge_lora_bytes=0)
    _, snap = _trained(off, "run-a", 1)
    assert not isinstance(off.decode_model(snap), MergedDecoder)


def test_bfloat16_models_are_never_merged(tiny_model_dir):
    host = _host(tiny_model_dir, dtype=torch.bfloat16)
    _, snapshot = _trained(host, "run-a", 1)
    assert not isinstance(host.decode_model(snapshot), MergedDecoder)
