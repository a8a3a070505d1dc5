"""`pytrio-compat run` / `python -m pytrio_compat run`: unmodified `import pytrio` scripts run on this SDK,
and a real pytrio installed beside it is never shadowed (ordinary imports) nor silently replaced (run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pytrio_compat

HERE = Path(__file__).resolve().parent
CLI = Path(sys.executable).parent / "pytrio-compat"
PROBE = """
import importlib.metadata, sys
import pytrio
print(getattr(pytrio, "REAL", False), pytrio.__name__, importlib.metadata.version("pytrio"), sys.argv[1:])
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTRIO_BASE_URL")}
    return {**env, **extra}


@pytest.fixture()
def no_real_pytrio(tmp_path) -> str:
    """A PYTHONPATH entry under which no real ``pytrio`` is importable, even where one is installed (the dev extra
    installs the official SDK): its ``sitecustomize`` marks the name absent, as an environment without it would be."""
    site = tmp_path / "no-real-pytrio"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['pytrio'] = None\n")
    return str(site)


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture()
def fake_real_pytrio(tmp_path):
    """A stand-in for an installed PyTRIO: a `pytrio` package and its distribution metadata, version 9.9.9."""
    site = tmp_path / "site"
    (site / "pytrio").mkdir(parents=True)
    (site / "pytrio" / "__init__.py").write_text("REAL = True\n")
    (site / "pytrio-9.9.9.dist-info").mkdir()
    (site / "pytrio-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: pytrio\nVersion: 9.9.9\n")
    return site


def test_run_executes_an_unmodified_pytrio_script_against_the_worker(worker, no_real_pytrio, tmp_path):
    out = tmp_path / "out.json"
    result = _run([str(CLI), "run", str(HERE / "pytrio_script.py"), str(out), "tiny"],
                  _env(PYTRIO_BASE_URL=worker.base_url, PYTHONPATH=no_real_pytrio), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["module"] == "pytrio_compat" and report["types_module"] == "pytrio_compat.types"
    assert report["version"] == pytrio_compat.__version__
    assert report["argv"] == [str(HERE / "pytrio_script.py"), str(out), "tiny"]
    assert "tiny" in report["models"]
    assert report["loss_after"] < report["loss_before"]  # the optimizer step reached the worker
    assert len(report["sequences"]) == 2 and all(1 <= len(s) <= 3 for s in report["sequences"])
    assert report["caught"] == "validation.empty_training_data"  # pytrio.errors.base.ValidationError


def test_module_entry_point_passes_arguments_and_exit_codes(no_real_pytrio, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE + "sys.exit(int(sys.argv[1]))\n")
    result = _run([sys.executable, "-m", "pytrio_compat", "run", str(script), "3", "--flag"],
                  _env(PYTHONPATH=no_real_pytrio), tmp_path)
    assert result.returncode == 3, result.stderr
    assert result.stdout.split() == ["False", "pytrio_compat", pytrio_compat.__version__, "['3',", "'--flag']"]
    missing = _run([sys.executable, "-m", "pytrio_compat", "run", str(tmp_path / "nope.py")], _env(), tmp_path)
    assert missing.returncode == 2 and "no such script" in missing.stderr


def test_plain_imports_never_get_the_alias(fake_real_pytrio, no_real_pytrio, tmp_path):
    alone = _run([sys.executable, "-c", "import pytrio_compat, importlib.util; "
                                        "print(importlib.util.find_spec('pytrio'))"],
                 _env(PYTHONPATH=no_real_pytrio), tmp_path)
    assert alone.returncode == 0 and alone.stdout.strip() == "None", alone.stderr
    beside = _run([sys.executable, "-c", "import pytrio_compat, pytrio_compat.cli\n" + PROBE],
                  _env(PYTHONPATH=str(fake_real_pytrio)), tmp_path)
    assert beside.returncode == 0, beside.stderr
    assert beside.stdout.split()[:3] == ["True", "pytrio", "9.9.9"]


def test_run_refuses_to_pick_when_a_real_pytrio_is_installed(fake_real_pytrio, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = _env(PYTHONPATH=str(fake_real_pytrio))
    refused = _run([str(CLI), "run", str(script)], env, tmp_path)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "a real pytrio is installed" in refused.stderr and "--override" in refused.stderr
    forced = _run([str(CLI), "run", "--override", str(script), "x"], env, tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.split() == ["False", "pytrio_compat", pytrio_compat.__version__, "['x']"]
