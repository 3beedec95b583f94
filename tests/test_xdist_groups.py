"""make test's `--dist loadgroup` must keep an xdist_group on one process: test_run's shared runs
and the operator's end-to-end tests rely on it (tests/support/xdist_groups.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PROBE = """
import os, time, pytest
G = pytest.mark.xdist_group("shared")

@pytest.fixture(scope="session")
def shared():
    open(os.path.join({out!r}, "setup-" + os.environ["PYTEST_XDIST_WORKER"]), "w").close()

def ran(name):
    open(os.path.join({out!r}, name + "-" + os.environ["PYTEST_XDIST_WORKER"]), "w").close()
    time.sleep(0.3)

@G
def test_a(shared): ran("a")

@G
@pytest.mark.parametrize("n", [1, 2, 3])
def test_b(shared, n): ran(f"b{{n}}")

def test_c(): ran("c")

def test_d(): ran("d")
"""


@pytest.mark.timeout(120)
def test_a_group_runs_on_one_process_with_its_session_fixture_made_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "test_probe.py").write_text(PROBE.format(out=str(out)))
    support = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(support), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "support.xdist_groups"]
        + ["-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    setups = [f for f in files if f.startswith("setup-")]
    assert len(setups) == 1, files
    worker = setups[0].removeprefix("setup-")
    assert {f for f in files if f[0] in "ab"} == {f"{t}-{worker}" for t in ("a", "b1", "b2", "b3")}, files
