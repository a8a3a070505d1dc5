"""RestClient's listings against the real worker, as PyTRIO's RestClient pages them: the caller's training runs
(oldest first, ``limit`` from ``offset``, with the total), the user's checkpoints of every run, and the
download source of a checkpoint; other tenants' runs never appear; page bounds at the limit and one past."""

from __future__ import annotations

import httpx
import pytest
from support import running_worker

import pytrio_compat as trio
from pytrio_compat.errors import ValidationError
from pytrio_compat.wire import MAX_LIST_LIMIT

KEY_A, KEY_B = "listing-key-a", "listing-key-b"


@pytest.fixture(scope="module")
def two_tenants(tiny_model_dir, tmp_path_factory):
    with running_worker(tiny_model_dir, tmp_path_factory.mktemp("listings"), api_keys=[KEY_A, KEY_B],
                        in_process=True) as proc:
        a = trio.ServiceClient(base_url=proc.base_url, api_key=KEY_A)
        b = trio.ServiceClient(base_url=proc.base_url, api_key=KEY_B)
        try:
            yield proc, a, b
        finally:
            a.close()
            b.close()


def test_training_runs_are_paged_oldest_first_and_per_tenant(two_tenants):
    proc, a, b = two_tenants
    made = [a.create_lora_training_client("tiny", rank=r, seed=r) for r in (4, 8, 16)]
    b.create_lora_training_client("tiny", rank=4, seed=0)  # another tenant's run: never listed to A
    ids = [tc.training_run_id for tc in made]
    rest = a.create_rest_client()

    first = rest.list_training_runs(limit=2).result()
    assert [r.training_run_id for r in first.training_runs] == ids[:2]
    assert [r.lora_rank for r in first.training_runs] == [4, 8]
    assert (first.cursor.offset, first.cursor.limit, first.cursor.total_count) == (0, 2, 3)
    rest_of = rest.list_training_runs(limit=2, offset=2).result()
    assert [r.training_run_id for r in rest_of.training_runs] == ids[2:]
    assert rest.list_training_runs(limit=2, offset=3).result().training_runs == []  # next+1 past the end
    assert len(b.create_rest_client().list_training_runs().result().training_runs) == 1

    with httpx.Client(base_url=proc.base_url, headers={"Authorization": f"Bearer {KEY_A}"}) as http:
        http.delete(f"/v1/training_runs/{ids[1]}").raise_for_status()
        after = http.get("/v1/training_runs").json()
        assert [r["training_run_id"] for r in after["training_runs"]] == [ids[0], ids[2]]
        assert after["total_count"] == 2
        # the page bounds, at the limit and one past, each refused naming the field
        assert http.get("/v1/training_runs", params={"limit": MAX_LIST_LIMIT}).status_code == 200
        for params, field in (({"limit": MAX_LIST_LIMIT + 1}, "limit"), ({"limit": 0}, "limit"),
                              ({"offset": -1}, "offset"), ({"limit": "x"}, "limit")):
            answer = http.get("/v1/training_runs", params=params)
            assert answer.status_code == 400 and answer.json()["error"]["field"] == field, (params, answer.text)
        assert http.get("/v1/training_runs", params={"offset": 0}).status_code == 200


def test_sdk_page_bounds_are_checked_before_sending(two_tenants):
    _, a, _ = two_tenants
    rest = a.create_rest_client()
    for limit, offset in ((0, 0), (MAX_LIST_LIMIT + 1, 0), (1, -1), (True, 0)):
        with pytest.raises(ValidationError):
            rest.list_training_runs(limit=limit, offset=offset)
        with pytest.raises(ValidationError):
            rest.list_user_checkpoints(limit=limit, offset=offset)
    assert rest.list_training_runs(limit=MAX_LIST_LIMIT).result().cursor.limit == MAX_LIST_LIMIT


def test_user_checkpoints_pages_and_the_download_source(two_tenants, tmp_path):
    _, a, b = two_tenants
    tc = a.create_lora_training_client("tiny", rank=4, seed=1)
    paths = [tc.save_state(f"page-{i}").result().path for i in range(3)]
    rest = a.create_rest_client()
    everything = rest.list_user_checkpoints(limit=MAX_LIST_LIMIT).result()
    mine = [c.path for c in everything.checkpoints]
    assert set(paths) <= set(mine) and everything.cursor.total_count == len(mine)
    page = rest.list_user_checkpoints(limit=2, offset=1).result()
    assert [c.path for c in page.checkpoints] == mine[1:3]
    assert (page.cursor.offset, page.cursor.limit, page.cursor.total_count) == (1, 2, len(mine))
    assert b.create_rest_client().list_user_checkpoints().result().checkpoints == []

    source = rest.get_checkpoint_download_url(paths[0]).result()
    assert source.checkpoint_id == paths[0] and source.source == "actor"
    fetched = httpx.get(source.url)  # signed: no API key needed
    assert fetched.status_code == 200
    rest.download_checkpoint(paths[0], tmp_path / "ckpt.tar").result()
    assert fetched.content == (tmp_path / "ckpt.tar").read_bytes()
    with pytest.raises(trio.PyTrioError):
        b.create_rest_client().get_checkpoint_download_url(paths[0]).result()  # another tenant's: not found
