"""tinker-cookbook recipes, unmodified, against a real worker: the worker, the local data the recipes load, and a
runner for each recipe in its own process.

Skipped when ``tinker_cookbook`` is not installed (scripts/setup_env.sh installs it). Nothing leaves the machine:
the SDK and the cookbook talk to the worker on 127.0.0.1 (``TINKER_BASE_URL``); the pricing file the trainers fetch
at start goes to a dead local proxy (one warning); datasets are local folders named like their hub ids in the
recipes' working directory, which ``datasets.load_dataset("org/name")`` reads first.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("tinker_cookbook")

KEY = "tml-cookbook"
HUB_ID = "Qwen/Qwen3.5-9B-Base"  # sl_loop's and rl_loop's default model: model_info knows it (renderer role_colon)
GSM8K = Path("/work/shared/data/gsm8k")


@dataclass
class Cookbook:
    worker: object
    cwd: Path  # the recipes' working directory: local datasets, the tokenizer under the hub id
    runs: Path
    env: dict[str, str]
    tiny: str  # the tiny model's folder, also a served model name
    teacher: str  # a second tiny model (other weights), served under this name
    key: str = KEY
    hub_id: str = HUB_ID  # the tiny model served under this hub id too

    def run(self, module_or_code: str, *args: str, timeout: float = 900, code: bool = False) -> str:
        """Run a recipe module (``python -m``, chz ``key=value`` arguments) or a Python snippet; its output."""
        cmd = [sys.executable, "-c", module_or_code] if code else [sys.executable, "-m", module_or_code, *args]
        done = subprocess.run(cmd, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{cmd[:3]} {' '.join(args)} exited {done.returncode}:\n{output[-6000:]}"
        return output

    def metrics(self, name: str) -> list[dict]:
        path = self.runs / name / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def checkpoints(self, name: str) -> list[dict]:
        path = self.runs / name / "checkpoints.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_local_data(cwd: Path, tiny: Path) -> None:
    """The datasets the recipes load, as local folders named like their hub ids, and the tokenizer under the hub
    id that sl_loop and rl_loop use (a local folder of that relative path wins over the hub)."""
    alias = cwd / HUB_ID
    alias.mkdir(parents=True)
    for item in tiny.iterdir():
        if item.name.startswith("tokenizer") or item.name in ("special_tokens_map.json", "vocab.json", "merges.txt",
                                                              "config.json", "chat_template.jinja"):
            shutil.copy(item, alias / item.name)
    chats = [{"messages": [{"role": "user", "content": f"Say the number {i} in words."},
                           {"role": "assistant", "content": f"The number is {i}, written out in full."}],
              "category": "Generation", "prompt": f"Say the number {i} in words.", "prompt_id": str(i)}
             for i in range(64)]
    _jsonl(cwd / "HuggingFaceH4/no_robots/train.jsonl", chats[:48])
    _jsonl(cwd / "HuggingFaceH4/no_robots/test.jsonl", chats[48:])
    gsm = cwd / "openai/gsm8k"
    (gsm / "main").mkdir(parents=True)
    shutil.copy(GSM8K / "train.jsonl", gsm / "main/train.jsonl")
    shutil.copy(GSM8K / "test.jsonl", gsm / "main/test.jsonl")
    (gsm / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n"
                                   "  - split: train\n    path: main/train.jsonl\n"
                                   "  - split: test\n    path: main/test.jsonl\n---\n")
    pairs = [{"chosen": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: It is {2 * i}.",
              "rejected": f"\n\nHuman: What is {i} plus {i}?\n\nAssistant: I do not know."} for i in range(40)]
    _jsonl(cwd / "Anthropic/hh-rlhf/train.jsonl", pairs[:32])
    _jsonl(cwd / "Anthropic/hh-rlhf/test.jsonl", pairs[32:])
    _jsonl(cwd / "zwhe99/DeepMath-103K/train.jsonl",
           [{"question": f"Compute {i} times {i + 1}.", "final_answer": str(i * (i + 1))} for i in range(40)])


@pytest.fixture(scope="session")
def cookbook(tiny_model_dir, tmp_path_factory):
    from support import running_worker

    from server_mock.engine.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("cookbook")
    teacher_dir = make_tiny_model(root / "teacher-model", seed=1)
    cwd = root / "cwd"
    write_local_data(cwd, Path(tiny_model_dir))
    extra = ("--model", f"{HUB_ID}={tiny_model_dir}", "--model", f"teacher={teacher_dir}")
    with running_worker(tiny_model_dir, root, *extra, api_keys=[KEY], model_name=str(tiny_model_dir)) as worker:
        env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
        env.update({
            "TINKER_BASE_URL": worker.base_url, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(root / "hf"), "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
            # the trainers fetch a pricing file at start: a dead local proxy makes it fail at once (a warning)
            "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
            "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(Path.cwd())) if p),
        })
        yield Cookbook(worker, cwd, root / "runs", env, str(tiny_model_dir), "teacher")
