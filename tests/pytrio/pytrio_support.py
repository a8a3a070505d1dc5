"""Helpers of the PyTRIO protocol tests: the official ``pytrio`` SDK, unmodified, run as a user runs it (a script in
its own process, configured only by PYTRIO_BASE_URL and PYTRIO_API_KEY) against a real worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent / "scripts"
KEY_A, KEY_B = "pytrio-key-a", "pytrio-key-b"


def run_sdk(worker, key: str, script: str, plan: dict, workdir: Path, timeout: float = 300,
            wait: bool = True) -> dict | subprocess.Popen:
    """Run ``scripts/<script>.py`` with ``plan`` (JSON) and return what it reported (or, with ``wait=False``, the
    process: ``finish_sdk`` collects it). The SDK keeps its local files (~/.pytrio, ModelScope's cache) in
    ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    plan_file, out_file = workdir / "plan.json", workdir / "report.json"
    plan_file.write_text(json.dumps(plan))
    env = {**os.environ, "PYTRIO_BASE_URL": worker.base_url, "PYTRIO_API_KEY": key, "HOME": str(workdir)}
    process = subprocess.Popen([sys.executable, str(SCRIPTS / f"{script}.py"), str(plan_file), str(out_file)],
                               env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process.out_file, process.timeout = out_file, timeout
    return finish_sdk(process) if wait else process


def finish_sdk(process: subprocess.Popen) -> dict:
    try:
        output, _ = process.communicate(timeout=process.timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError("the SDK script did not finish:\n" + output[-4000:]) from None
    assert process.returncode == 0, f"the SDK script failed ({process.returncode}):\n{output[-6000:]}"
    return json.loads(process.out_file.read_text())
