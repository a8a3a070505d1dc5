"""Downloading checkpoints from a real worker, on every protocol: one archive per checkpoint, the same bytes
through our SDK, the official ``tinker`` CLI and the archive route of older Tinker SDKs; resumable with Range;
signed URLs that need no key, are refused for other tenants, and die with their checkpoint's version."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile

import httpx
import pytest
from support import run_cli

import pytrio_compat as trio

KEY_A, KEY_B = "key-a", "key-b"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory):
    from support import InProcessWorker

    root = tmp_path_factory.mktemp("downloads")
    proc = InProcessWorker(tiny_model_dir, root / "storage", api_keys=[KEY_A, KEY_B],
                           model_name=str(tiny_model_dir)).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def clients(worker):
    a, b = (trio.ServiceClient(base_url=worker.base_url, api_key=k) for k in (KEY_A, KEY_B))
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def trained(clients, tiny_model_dir):
    """Tenant A's run after one step, saved as a training checkpoint and as sampler weights."""
    service = clients[0]
    tc = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=2)
    ids = tc.get_tokenizer().encode("1 + 2 = 3. 4 + 5 = 9.")
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    return tc, tc.save_state("dl-state").result().path, tc.save_weights_for_sampler("dl-sampler").result().path


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def members(archive) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def test_the_archive_is_the_checkpoints_peft_folder(clients, trained, worker, tmp_path):
    _, state, sampler = trained
    rest = clients[0].create_rest_client()
    for path in (state, sampler):
        result = rest.download_checkpoint(path, tmp_path / "a.tar", resume=False).result()
        assert result.status_code == 200 and result.bytes_written == result.file_size_bytes > 0
        files = members(tmp_path / "a.tar")
        assert list(files) == ["adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"]
        folder = worker.storage / "checkpoints" / path.removeprefix("trio://")
        assert files["adapter_model.safetensors"] == (folder / "adapter_model.safetensors").read_bytes()
        assert files["adapter_config.json"] == (folder / "adapter_config.json").read_bytes()
        assert files["checkpoint_complete"] == b""
        assert (folder / ".archive.tar").read_bytes() == (tmp_path / "a.tar").read_bytes()  # built once, cached
    # the cached archive does not count in the checkpoint's size
    listed = {c.path: c.size_bytes for c in rest.list_checkpoints(state.split("/")[2]).result().checkpoints}
    folder = worker.storage / "checkpoints" / state.removeprefix("trio://")
    assert listed[state] == sum(f.stat().st_size for f in folder.iterdir() if not f.name.startswith("."))


def test_range_resume_and_the_complete_answer(clients, trained, tmp_path):
    _, state, _ = trained
    rest = clients[0].create_rest_client()
    full = tmp_path / "full.tar"
    rest.download_checkpoint(state, full).result()
    size = full.stat().st_size
    url = rest.get_checkpoint_archive_url(state).result().url

    plain = httpx.get(url)  # no API key at all
    assert plain.status_code == 200 and plain.content == full.read_bytes()
    assert int(plain.headers["content-length"]) == size
    part = httpx.get(url, headers={"Range": "bytes=100-"})
    assert part.status_code == 206 and part.headers["content-range"] == f"bytes 100-{size - 1}/{size}"
    assert part.content == full.read_bytes()[100:]
    last = httpx.get(url, headers={"Range": f"bytes={size - 1}-"})  # the last byte: still a range
    assert last.status_code == 206 and last.content == full.read_bytes()[-1:]
    done = httpx.get(url, headers={"Range": f"bytes={size}-"})  # one past the end: complete
    assert done.status_code == 416 and done.headers["content-range"] == f"bytes */{size}"

    partial = tmp_path / "partial.tar"
    partial.write_bytes(full.read_bytes()[: size // 3])
    resumed = rest.download_checkpoint(state, partial).result()
    assert resumed.resumed and resumed.status_code == 206 and resumed.bytes_written == size - size // 3
    assert sha(partial) == sha(full)
    again = rest.download_checkpoint(state, partial).result()
    assert again.status_code == 416 and again.bytes_written == 0 and sha(partial) == sha(full)
    fresh = rest.download_checkpoint(state, partial, resume=False).result()
    assert fresh.status_code == 200 and sha(partial) == sha(full)


def test_other_tenants_get_404_and_altered_urls_403(clients, trained, worker):
    _, state, sampler = trained
    rest_a, rest_b = (c.create_rest_client() for c in clients)
    url = rest_a.get_checkpoint_archive_url(sampler).result().url
    for path in (state, sampler):
        with pytest.raises(trio.PyTrioError) as err:
            rest_b.get_checkpoint_archive_url(path).result()
        assert err.value.status_code == 404
    assert httpx.get(url, headers={"X-API-Key": KEY_B}).status_code == 404  # B holding A's URL
    assert httpx.get(url, headers={"X-API-Key": KEY_A}).status_code == 200
    token = url.split("/downloads/")[1].split("/")[0]
    payload, signature = token.split(".")
    forged = url.replace(token, f"{payload}.{signature[:-2]}AA")
    assert httpx.get(forged).status_code == 403
    # a URL for tenant B's own checkpoint cannot be made into tenant A's by editing the payload
    tinker_b = httpx.get(f"{worker.base_url}/api/v1/training_runs/{sampler.split('/')[2]}/checkpoints/"
                         f"sampler_weights/dl-sampler/archive", headers={"X-API-Key": KEY_B}, follow_redirects=False)
    assert tinker_b.status_code == 404


def test_snapshots_have_nothing_to_download(clients, trained):
    tc, _, _ = trained
    sampler = tc.save_weights_and_get_sampling_client()
    with pytest.raises(trio.PyTrioError, match="in-memory sampler snapshot") as err:
        clients[0].create_rest_client().get_checkpoint_archive_url(sampler.model_path).result()
    assert err.value.status_code == 400


def test_overwrite_and_delete_take_the_archive_and_its_urls_with_them(clients, trained, worker, tmp_path):
    tc, _, _ = trained
    rest = clients[0].create_rest_client()
    path = tc.save_state("dl-overwritten").result().path
    rest.download_checkpoint(path, tmp_path / "v1.tar").result()
    old_url = rest.get_checkpoint_archive_url(path).result().url
    ids = [3, 9, 27, 81, 100]
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    tc.forward_backward([datum]).result()
    tc.optim_step(trio.AdamParams(learning_rate=1e-2)).result()
    tc.save_state("dl-overwritten", overwrite=True).result()
    stale = httpx.get(old_url)
    assert stale.status_code == 404 and stale.json()["error"]["code"] == "download_changed"
    rest.download_checkpoint(path, tmp_path / "v2.tar").result()
    folder = worker.storage / "checkpoints" / path.removeprefix("trio://")
    v1, v2 = (members(tmp_path / f"{v}.tar")["adapter_model.safetensors"] for v in ("v1", "v2"))
    assert v2 == (folder / "adapter_model.safetensors").read_bytes() and v1 != v2
    url = rest.get_checkpoint_archive_url(path).result().url
    rest.delete_checkpoint("run", path).result()
    assert httpx.get(url).status_code == 404 and not folder.exists()


def test_tinker_cli_and_older_sdks_fetch_the_same_archive(clients, trained, worker, tmp_path):
    """``tinker checkpoint download`` (the official 0.38 CLI: one signed URL per file) and the archive route of
    older SDKs (a 302 to the tar) give the files that our ``download_checkpoint`` gives."""
    _, state, sampler = trained
    ours = tmp_path / "ours.tar"
    clients[0].create_rest_client().download_checkpoint(state, ours).result()
    tinker_path = state.replace("trio://", "tinker://").replace("/state/", "/weights/")
    env = {**os.environ, "TINKER_BASE_URL": worker.base_url, "TINKER_API_KEY": f"tml-{KEY_A}",
           "TINKER_TELEMETRY": "0", "NO_PROXY": "127.0.0.1,localhost"}
    done = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", tinker_path,
                           "-o", str(tmp_path / "cli")], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    folder = tmp_path / "cli" / tinker_path.removeprefix("tinker://").replace("/", "_")
    cli_files = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert cli_files == members(ours)  # a tied model: PEFT naming in both (see api/tinker/export.py)
    run = state.split("/")[2]
    assert not list((worker.storage / "checkpoints" / run).glob("external/*"))  # the CLI deleted its export

    for kind, path in (("weights", state), ("sampler_weights", sampler)):
        name = path.rsplit("/", 1)[1]
        redirect = httpx.get(f"{worker.base_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive",
                             headers={"X-API-Key": f"tml-{KEY_A}"}, follow_redirects=False)
        assert redirect.status_code == 302 and redirect.headers["expires"].endswith("GMT")
        assert redirect.json()["url"] == redirect.headers["location"]
        fetched = httpx.get(redirect.headers["location"])
        mine = tmp_path / f"{kind}.tar"
        clients[0].create_rest_client().download_checkpoint(path, mine, resume=False).result()
        assert fetched.content == mine.read_bytes()


def test_worker_export_command_merges_a_stored_checkpoint(clients, trained, worker, tmp_path):
    """``pytrio-worker export trio://... --merged OUT`` next to the storage, and ``pytrio-compat export`` on the
    downloaded archive, write the same merged model; a checkpoint that is not there is refused with the reason."""
    from safetensors.torch import load_file

    _, state, _ = trained
    # the worker's CLI in a process of its own, forked warm (support.run_cli)
    command = ["export", state, "--storage", str(worker.storage),
               "--merged", str(tmp_path / "worker-merged"), "--gguf", str(tmp_path / "model.gguf")]
    done = run_cli(command, tmp_path / "cli", timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["merged"]["untied_head"]
    archive = tmp_path / "ckpt.tar"
    clients[0].create_rest_client().download_checkpoint(state, archive).result()
    from pytrio_compat.cli import main as compat_main

    base = json.loads(members(archive)["adapter_config.json"])["base_model_name_or_path"]
    assert compat_main(["export", str(archive), "--base", base, "--merged", str(tmp_path / "client-merged")]) == 0
    ours, theirs = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("worker-merged", "client-merged"))
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
    assert (tmp_path / "model.gguf").stat().st_size > 0

    missing = state.rsplit("/", 1)[0] + "/not-there"
    done = run_cli([command[0], missing, *command[2:4], "--merged", str(tmp_path / "x")], tmp_path / "cli",
                   timeout=120)
    assert done.returncode == 2 and "no such checkpoint" in done.stderr and not (tmp_path / "x").exists()
