"""The official ``pytrio`` SDK, unmodified, against a real worker: the canonical flow of a PyTRIO user
(ServiceClient, capabilities, a LoRA client, forward_backward with all five losses, optim_step, sampling, save and
resume, the REST client's listings, download and delete, forward_backward_custom), checked against numpy, against
this project's own SDK on the same worker and data, and against the checkpoints on disk."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
from pytrio_support import KEY_A, KEY_B, finish_sdk, run_sdk
from transformers import AutoTokenizer, GenerationConfig

import pytrio_compat as ours
from server_mock.engine.host import default_stop_ids
from server_mock.storage.checkpoints import CheckpointStore, parse_path

pytest.importorskip("pytrio", reason="the official pytrio SDK (the dev extra) is not installed")

POLICY = ("importance_sampling", "ppo", "cispo", "dro")
CONFIGS = {"cross_entropy": None, "importance_sampling": None,
           "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, "cispo": None, "dro": {"beta": 0.3}}
TEXTS = ["12 + 30 = 42. The answer is 42.", "7 + 8 = 15", "what is 3 + 4? it is 7."]


def _rows(tokenizer, rng: np.random.Generator, policy: bool) -> list[dict]:
    rows = []
    for text in TEXTS:
        ids = tokenizer.encode(text)
        n = len(ids) - 1
        target = list(ids[1:])
        target[0] = -100  # an ignored position stays out of every loss and count
        row = {"tokens": ids[:-1], "target_tokens": target}
        if policy:
            row["logprobs"] = (-rng.uniform(0.5, 4.0, n)).round(4).tolist()
            advantages = rng.normal(0, 1, n).round(4)
            advantages[1] = 0.0  # a zero advantage: active for the SDK's count, no gradient
            row["advantages"] = advantages.tolist()
        else:
            weights = rng.uniform(0.2, 1.5, n).round(4)
            weights[2] = 0.0
            row["weights"] = weights.tolist()
        rows.append(row)
    return rows


def _reference_loss(loss: str, lp: np.ndarray, row: dict, config: dict | None) -> float:
    """The summed loss of one datum, from its logprobs and inputs (float64)."""
    mask = np.asarray(row["target_tokens"]) != -100
    if loss == "cross_entropy":
        return float(np.sum((-np.asarray(row["weights"]) * lp)[mask]))
    q, a = np.asarray(row["logprobs"]), np.asarray(row["advantages"])
    r = np.exp(lp - q)
    config = config or {}
    if loss == "importance_sampling":
        per = -r * a
    elif loss == "ppo":
        per = -np.minimum(r * a, np.clip(r, config["clip_low_threshold"], config["clip_high_threshold"]) * a)
    elif loss == "cispo":
        per = -np.clip(r, 0.0, 4.0) * lp * a
    else:
        per = -(lp * a - 0.5 * config["beta"] * (lp - q) ** 2)
    return float(np.sum(per[mask]))


def _active(loss: str, row: dict) -> int:
    mask = np.asarray(row["target_tokens"]) != -100
    if loss == "cross_entropy":
        mask &= np.asarray(row["weights"]) != 0
    return int(mask.sum())


def _ours_datum(row: dict) -> ours.Datum:
    inputs = {k: np.asarray(v, dtype=np.int64 if k == "target_tokens" else np.float32)
              for k, v in row.items() if k != "tokens"}
    return ours.Datum(model_input=ours.ModelInput.from_ints(row["tokens"]), loss_fn_inputs=inputs)


def _native_paths(client: ours.ServiceClient) -> list[str]:
    return [c.path for c in client.create_rest_client().list_user_checkpoints().result().checkpoints]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def plan(tokenizer):
    rng = np.random.default_rng(0)
    ce, policy = _rows(tokenizer, rng, False), _rows(tokenizer, rng, True)
    probe_ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    custom = [{"tokens": r["tokens"], "target_tokens": r["target_tokens"]} for r in ce[:2]]
    coefficients = [[0.0 if t == -100 else float(c)
                     for t, c in zip(r["target_tokens"], rng.uniform(0.5, 2, len(r["tokens"])).round(3))]
                    for r in custom]
    return {"model": "tiny", "text": "hello world",
            "losses": [[loss, ce if loss == "cross_entropy" else policy, CONFIGS[loss]] for loss in CONFIGS],
            "probe": {"tokens": probe_ids[:-1], "target_tokens": probe_ids[1:]},
            "prompt": tokenizer.encode("what is two plus two?"),
            "next_batch": [{"tokens": r["tokens"], "target_tokens": r["target_tokens"]} for r in ce],
            "custom": custom, "custom_coefficients": coefficients}


@pytest.fixture(scope="module")
def report(pytrio_worker, plan, tmp_path_factory):
    return run_sdk(pytrio_worker, KEY_A, "canonical_flow", plan, tmp_path_factory.mktemp("canonical"))


@pytest.fixture(scope="module")
def ours_client(pytrio_worker):
    client = ours.ServiceClient(base_url=pytrio_worker.base_url, api_key=KEY_A)
    yield client
    client.close()


def test_session_capabilities_and_tokenizer(report, tiny_model_dir, tokenizer):
    model_id = str(tiny_model_dir.resolve())
    assert report["capabilities"] == [model_id] and report["supported_models"] == [model_id]
    assert report["model_id"] == model_id  # the SDK loaded its tokenizer from there
    assert report["tokenizer_encodes"] == tokenizer.encode("hello world")


def test_five_losses_match_numpy_and_our_own_sdk(report, plan, ours_client):
    reference = ours_client.create_lora_training_client("tiny", rank=8, seed=7)  # the same initial adapter
    for loss, rows, config in plan["losses"]:
        got = report["fb"][loss]
        assert got["shapes"] == [[len(r["tokens"])] for r in rows]
        logprobs = [np.asarray(lp) for lp in got["logprobs"]]
        expected = sum(_reference_loss(loss, lp, row, config) for lp, row in zip(logprobs, rows))
        metrics = got["metrics"]
        assert metrics["loss_sum"] == pytest.approx(expected, rel=1e-5, abs=1e-5)
        count = sum(_active(loss, row) for row in rows)
        assert metrics["token_count"] == count  # the SDK's count: a zero advantage is active, a zero weight is not
        assert metrics["loss_mean"] == pytest.approx(metrics["loss_sum"] / count, rel=1e-9)
        assert all(lp[0] == 0.0 for lp in logprobs)  # ignored positions carry 0
        mine = reference.forward([_ours_datum(r) for r in rows], loss, config).result()
        assert mine.metrics["loss_sum"] == pytest.approx(metrics["loss_sum"], rel=1e-5, abs=1e-5)
        for lp, out in zip(logprobs, mine.loss_fn_outputs):
            np.testing.assert_allclose(lp, np.asarray(out["logprobs"].data), atol=1e-5, rtol=0)
    kind, code, message = report["refused"]  # an unknown loss option: a failed event, and the client went on
    assert (kind, code) == ("EventFailedError", "invalid_loss") and "loss_fn_config.clip_epsilon" in message
    assert report["optim"]["grad_norm"] > 0 and report["optim"]["learning_rate"] == pytest.approx(1e-2)
    before = reference.forward([_ours_datum(plan["probe"])], "cross_entropy").result()
    moved = np.abs(np.asarray(report["after_step"][0]) - np.asarray(before.loss_fn_outputs[0]["logprobs"].data))
    assert moved.max() > 1e-3  # the step reached the weights


def test_sampling_with_prompt_logprobs_and_stops(report, plan, tokenizer, tiny_model_dir):
    sample = report["sample"]
    n_prompt = len(plan["prompt"])
    assert len(sample["tokens"]) == 4 and sample["again"] == sample["tokens"]  # seeded
    for tokens, logprobs, reason in zip(sample["tokens"], sample["logprobs"], sample["stop_reasons"]):
        assert len(logprobs) == len(tokens) and all(lp <= 0 for lp in logprobs)
        assert (reason, len(tokens)) == ("length", 6)  # stop=[]: not even EOS ends them
    prompt_lps = sample["prompt_logprobs"]
    assert len(prompt_lps) == n_prompt and prompt_lps[0] is None and all(lp < 0 for lp in prompt_lps[1:])
    topk = sample["topk_prompt_logprobs"]
    assert len(topk) == n_prompt and topk[0] is None
    for i, row in enumerate(topk[1:], start=1):
        assert len(row) == 2 and row[0][1] >= row[1][1] and row[0][1] >= prompt_lps[i] - 1e-5
    first = sample["tokens"][0]
    stop = report["stop_token"]
    assert stop["tokens"] == first[:first.index(stop["id"]) + 1] and stop["stop_reason"] == "stop"
    text = report["stop_string"]["text"]  # with stop strings, end of turn still stops (stop_token_ids replaces it)
    eos = set(default_stop_ids(tokenizer, GenerationConfig.from_pretrained(str(tiny_model_dir))))
    k = next(k for k in range(1, len(first) + 1) if first[k - 1] in eos or text in tokenizer.decode(first[:k]))
    assert report["stop_string"]["tokens"] == first[:k] and report["stop_string"]["stop_reason"] == "stop"
    # the sampler's prompt logprobs are the trainer's, on the same weights
    np.testing.assert_allclose(report["compute_logprobs"][1:], report["after_step"][0][:-1], atol=1e-4)
    np.testing.assert_allclose(report["from_weights_probe"][1:], report["trainer_probe_now"][0][:-1], atol=1e-4)


def test_resumed_run_is_bit_identical_to_the_uninterrupted_one(report, pytrio_worker):
    store = CheckpointStore(pytrio_worker.storage)
    at_save = store.fingerprint(parse_path(report["state_path"]))
    uninterrupted = store.fingerprint(parse_path(report["uninterrupted"]))
    resumed = store.fingerprint(parse_path(report["resumed"]))
    assert resumed == uninterrupted  # weights and Adam moments, byte for byte
    assert resumed != at_save  # and the step after the resume did move them
    assert parse_path(report["resumed"]).run_id == report["resumed_run"]
    np.testing.assert_array_equal(report["load_state_probe"], report["after_step"])  # load_state (PATCH)


def test_rest_listing_download_and_delete(report, pytrio_worker, ours_client):
    state, weights = report["state_path"], report["weights_path"]
    listed = {path: (kind, size) for _, kind, path, size in report["run_checkpoints"]}
    assert listed[state][0] == "training" and listed[weights][0] == "sampler"
    folder = CheckpointStore(pytrio_worker.storage).folder(parse_path(state))
    # the checkpoint's files; the download archive cached beside them (.archive.tar) is not counted
    assert listed[state][1] == sum(f.stat().st_size for f in folder.iterdir() if not f.name.startswith("."))
    assert {state, weights, report["resumed"]} <= set(report["user_checkpoints"])
    assert report["run_info"]["lora_rank"] == 8 and report["training_run"] in report["training_runs"]
    assert report["sampler_info"]["base_model"] == "tiny"
    assert len(report["sessions"]) == 1  # this key's open sessions: the script's own
    assert report["training_run"] in report["session"]["training_run_ids"]
    assert report["session"]["sampler_ids"]
    download = report["download"]
    assert download["full"]["status_code"] == 200 and not download["full"]["resumed"]
    assert download["resume"]["status_code"] == 206 and download["resume"]["resumed"]
    assert download["resume"]["bytes_written"] == download["full"]["file_size_bytes"] - 100
    assert download["complete"]["status_code"] == 416 and download["complete"]["bytes_written"] == 0
    assert download["same_after_resume"]
    with tarfile.open(fileobj=io.BytesIO(open(download["path"], "rb").read())) as tar:
        names = {m.name.split("/")[-1]: m for m in tar.getmembers()}
        # the archive every protocol serves: the PEFT folder and the completion marker (no optimizer, no metadata)
        assert set(names) == {"adapter_model.safetensors", "adapter_config.json", "checkpoint_complete"}
        inside = tar.extractfile(names["adapter_model.safetensors"]).read()
    assert inside == (folder / "adapter_model.safetensors").read_bytes()
    # deleted through PyTRIO: gone for every protocol of this key
    assert weights not in report["after_delete"] and state in report["after_delete"]
    assert weights not in _native_paths(ours_client)


def test_checkpoints_cross_protocols_and_stay_with_their_key(report, pytrio_worker, ours_client):
    assert report["state_path"] in _native_paths(ours_client)  # saved through PyTRIO, listed by the native API
    other = ours.ServiceClient(base_url=pytrio_worker.base_url, api_key=KEY_B)
    try:
        assert report["state_path"] not in _native_paths(other)
        with pytest.raises(Exception, match="checkpoint_not_found|no checkpoint"):
            other.create_training_client_from_state(report["state_path"])
    finally:
        other.close()


def test_forward_backward_custom_is_the_mean_reduced_linear_surrogate(report, plan, ours_client):
    custom = report["custom"]
    coefficients = [np.asarray(c) for c in plan["custom_coefficients"]]
    value = -sum(float(np.sum(c * np.asarray(lp))) for c, lp in zip(coefficients, custom["logprobs"]))
    assert custom["metrics"]["custom_metric"] == pytest.approx(value, rel=1e-5, abs=1e-5)
    # the SDK sends CE with weights = -dL/dlogprob = c; the worker divides that call by its active tokens T, so
    # the step equals our own SDK's on weights c / T from the same state
    active = sum(int(np.count_nonzero(c)) for c in coefficients)
    reference = ours_client.create_training_client_from_state(report["state_path"])
    data = [_ours_datum({**row, "weights": (c / active).tolist()}) for row, c in zip(plan["custom"], coefficients)]
    reference.forward_backward(data, "cross_entropy").result()
    step = reference.optim_step(ours.AdamParams(learning_rate=1e-3)).result()
    assert custom["optim"]["grad_norm"] == pytest.approx(step.metrics["grad_norm"], rel=1e-5)


def test_two_tenants_train_at_once_and_never_meet(pytrio_worker, plan, tmp_path):
    rows = plan["next_batch"]
    jobs = {key: run_sdk(pytrio_worker, key, "tenant_job", {"model": "tiny", "rows": rows, "name": f"job-{key}"},
                         tmp_path / key, wait=False) for key in (KEY_A, KEY_B)}
    a, b = (finish_sdk(jobs[key]) for key in (KEY_A, KEY_B))
    # the same seed and data on one shared model: the same numbers, as if each had the worker alone
    np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-6)
    assert a["losses"][2] < a["losses"][0] and a["sample"] == b["sample"]
    assert a["state"] in a["listed"] and b["state"] in b["listed"]
    assert a["state"] not in b["listed"] and b["state"] not in a["listed"]
