"""The console in a real browser: Debian's headless Chromium driven by playwright (never playwright's own browser
download). It refuses a wrong key and a tenant's key, signs in with the admin key, sees a run appear and its step
advance while a client trains, and takes the screenshot docs/operations.md shows (docs/console.png)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

import pytrio_compat as trio

from .operator_support import ADMIN_KEY, OTHER_KEY, TENANT_KEY, operator_worker

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "console.png"

pytestmark = pytest.mark.slow


def _browser_or_skip():
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "playwright is not installed (pip install -e .[dev])"
    if reason is None and not os.path.exists(CHROMIUM):
        reason = f"no Chromium at {CHROMIUM} (as root: apt-get install -y chromium; .ci/run does)"
    if reason is not None:
        if os.environ.get("PYTRIO_REQUIRE_EXTRAS") == "1" and shutil.which("apt-get"):
            pytest.fail(f"PYTRIO_REQUIRE_EXTRAS=1 and apt is available, but {reason}")
        pytest.skip(reason)
    return sync_playwright


def _train(url: str, key: str, stop: threading.Event, steps: list[int]) -> None:
    client = trio.ServiceClient(base_url=url, api_key=key)
    tc = client.create_lora_training_client("tiny", rank=4, seed=1)
    ids = list(range(20, 61))
    datum = trio.Datum(model_input=trio.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]})
    while not stop.is_set():
        tc.forward_backward([datum, datum]).result()
        steps.append(int(tc.optim_step(trio.AdamParams(learning_rate=1e-3)).result().metrics["step"]))
        time.sleep(0.3)
    client.close()


def _sample(url: str, key: str, stop: threading.Event) -> None:
    client = trio.ServiceClient(base_url=url, api_key=key)
    sampler = client.create_sampling_client(base_model="tiny")
    while not stop.is_set():
        sampler.sample(trio.ModelInput.from_ints([5, 6, 7, 8]), num_samples=4,
                       sampling_params=trio.SamplingParams(max_tokens=24, seed=1)).result()
    client.close()


def test_console_signs_in_and_follows_a_training_run(tiny_model_dir, tmp_path):
    sync_playwright = _browser_or_skip()
    with operator_worker(tiny_model_dir, tmp_path / "storage") as worker, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        sent = []
        page.on("request", lambda r: sent.append((r.url, r.headers.get("x-admin-key"))))
        page.goto(worker.url + "/console")
        assert page.is_visible("#key") and not page.is_visible("#view")

        for wrong, status in (("not-a-key", "401"), (TENANT_KEY, "403")):
            page.fill("#key", wrong)
            page.click("#sign-in")
            page.wait_for_selector("#error:not([hidden])")
            assert f"refused ({status})" in page.inner_text("#error")
            assert not page.is_visible("#view") and page.evaluate("sessionStorage.length") == 0

        stop, steps = threading.Event(), []
        trainer = threading.Thread(target=_train, args=(worker.url, TENANT_KEY, stop, steps), daemon=True)
        sampler = threading.Thread(target=_sample, args=(worker.url, OTHER_KEY, stop), daemon=True)
        trainer.start()
        sampler.start()
        httpx.get(worker.url + "/v1/training_runs/run-00000000000000000000",
                  headers={"authorization": f"Bearer {OTHER_KEY}"})  # an error for the console to list
        try:
            page.fill("#key", ADMIN_KEY)
            page.click("#sign-in")
            page.wait_for_selector("#view:not([hidden])")
            row = page.wait_for_selector("tr.run", timeout=60_000)  # the run appears
            run_id = row.get_attribute("data-run-id")
            assert run_id and run_id.startswith("run-")
            first = int(page.inner_text(f'tr.run[data-run-id="{run_id}"] .step'))
            page.wait_for_function(  # and its step advances while the client trains
                "([id, first]) => { const c = document.querySelector(`tr.run[data-run-id=\"${id}\"] .step`);"
                " return c && Number(c.textContent) >= first + 2; }", arg=[run_id, first], timeout=90_000)
            page.wait_for_selector("tr.error", timeout=30_000)
            page.wait_for_function("() => !document.body.innerText.includes('…')", timeout=30_000)  # rates shown
            time.sleep(1.5)  # a refresh with both tenants busy, for the picture
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
            assert page.evaluate("sessionStorage.length") == 1
        finally:
            stop.set()
            trainer.join(60)
            sampler.join(60)
        assert steps and steps[-1] >= first + 2
        browser.close()
    assert all(ADMIN_KEY not in url for url, _ in sent)  # never in a URL...
    assert any(url.endswith("/operator/state") and key == ADMIN_KEY for url, key in sent)  # ...always a header
    assert SCREENSHOT.stat().st_size > 10_000
