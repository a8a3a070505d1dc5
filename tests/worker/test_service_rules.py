"""The service's own rules, checked once and named in the front end's field: the LoRA layout a run may ask for,
the run quotas (with runs a front end promised but has not made yet), and a checkpoint's layout against a run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pytrio_compat.wire import LoraSpec
from server_mock.config import Limits
from server_mock.errors import WorkerError
from server_mock.service.checkpoints import Checkpoints
from server_mock.service.runs import Runs


def runs(**limits) -> Runs:
    owned = [SimpleNamespace(tenant="A"), SimpleNamespace(tenant="B")]
    return SimpleNamespace(limits=Limits(**limits), _runs={str(i): r for i, r in enumerate(owned)})


def test_the_rank_is_bounded_at_the_limit_and_one_past_in_the_callers_field():
    rules = runs(max_lora_rank=8)
    Runs.check_spec(rules, LoraSpec(rank=8))
    Runs.check_spec(rules, LoraSpec(rank=1))
    for rank in (0, 9):
        with pytest.raises(WorkerError) as bad:
            Runs.check_spec(rules, LoraSpec(rank=rank), rank_field="lora_rank")
        assert (bad.value.status, bad.value.field) == (400, "lora_rank") and "--max-lora-rank" in bad.value.message
    with pytest.raises(WorkerError) as nothing:
        Runs.check_spec(rules, LoraSpec(rank=4, train_mlp=False, train_attn=False, train_unembed=False),
                        switches_field="train_mlp")
    assert nothing.value.field == "train_mlp"


def test_run_quotas_count_what_a_front_end_promised():
    rules = runs(max_training_runs=3, max_adapters=4)  # A has 1 run, B has 1
    Runs.check_room(rules, "A", pending=1)  # A: 2 of 3
    with pytest.raises(WorkerError) as per_key:
        Runs.check_room(rules, "A", pending=2)  # A: 3 of 3
    assert (per_key.value.status, per_key.value.code) == (429, "too_many_training_runs")
    Runs.check_room(rules, "B", pending_all=1)  # the worker: 3 of 4
    with pytest.raises(WorkerError) as worker:
        Runs.check_room(rules, "B", pending_all=2)  # 4 of 4
    assert (worker.value.status, worker.value.code) == (429, "too_many_adapters")


def test_a_checkpoint_layout_is_compared_field_by_field():
    meta = {"base_model": "tiny", "lora": LoraSpec(rank=8).model_dump()}
    Checkpoints.check_layout(meta, LoraSpec(rank=8), "tiny", "path")
    Checkpoints.check_layout(meta, LoraSpec(rank=8), None, "path")  # the base model not compared
    with pytest.raises(WorkerError) as differs:
        Checkpoints.check_layout(meta, LoraSpec(rank=4, train_attn=not LoraSpec().train_attn), "other",
                                 "source_checkpoint_uri")
    assert differs.value.field == "source_checkpoint_uri" and differs.value.code == "checkpoint_config_mismatch"
    assert "base_model, rank, train_attn" in differs.value.message


def test_reused_samplers_are_bounded_per_key_and_made_again_when_dropped():
    import asyncio

    from pytrio_compat.wire import CreateSampler
    from server_mock.service.samplers import ReusedSamplers

    class FakeSamplers:
        def __init__(self) -> None:
            self.made: dict[str, str] = {}
            self.count = 0

        async def create(self, body, tenant):
            sampler_id, self.count = f"s{self.count}", self.count + 1
            self.made[sampler_id] = tenant
            return SimpleNamespace(sampler_id=sampler_id)

        def get(self, sampler_id, tenant):
            if self.made.get(sampler_id) != tenant:
                raise WorkerError(404, "sampler_not_found", sampler_id)
            return SimpleNamespace(sampler_id=sampler_id)

    async def scenario():
        samplers = FakeSamplers()
        reused = ReusedSamplers(samplers, per_tenant=2)
        b_first = (await reused.get(CreateSampler(base_model="m0"), "B")).sampler_id
        a = [(await reused.get(CreateSampler(base_model=f"m{i}"), "A")).sampler_id for i in range(3)]
        assert reused.count("A") == 2 and reused.count("B") == 1  # A's third evicted A's first, not B's
        assert (await reused.get(CreateSampler(base_model="m0"), "B")).sampler_id == b_first
        assert (await reused.get(CreateSampler(base_model="m2"), "A")).sampler_id == a[2]  # reused
        del samplers.made[a[2]]  # the service dropped it: made again
        assert (await reused.get(CreateSampler(base_model="m2"), "A")).sampler_id not in a

    asyncio.run(scenario())
