"""The base install (`pip install sparrowrl`, no extras) is the CLI, the job spec, the roles of
a job and the status model, without torch: what the operator's image carries. Built from this checkout into a venv of
its own, as a user installs it."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.jobs import job

pytestmark = pytest.mark.e2e


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    p = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return venv / "bin"


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("base-install")  # one worker makes the venv of `base`
def test_the_base_install_has_the_job_spec_and_status_without_torch(base):
    listed = subprocess.run([str(base / "pip"), "list"], capture_output=True, text=True, timeout=120).stdout.lower()
    assert "pydantic" in listed and not any(
        f"\n{m} " in listed for m in ("torch", "numpy", "aiohttp", "numba", "datasets", "pyarrow")
    )
    code = (
        "import sys; from sparrowrl.spec.job import parse; from sparrowrl.spec.status import TrainerStatus; "
        "import sparrowrl.cli.main; "
        "from sparrowrl.spec.layout import processes; "
        f"j = parse({job('x')!r}); "
        "TrainerStatus(phase='Pending', step=0, steps=j.spec.steps, version=0); "
        "assert [r.kind for r in processes(j.spec, lambda n, r: n)][0] == 'trainer'; "
        "print(sorted(m for m in ('torch', 'numpy', 'aiohttp') if m in sys.modules))"
    )
    p = subprocess.run([str(base / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr


@pytest.mark.timeout(900)
@pytest.mark.xdist_group("base-install")
def test_the_base_cli_says_what_a_command_needs(base, tmp_path):
    p = subprocess.run(
        [str(base / "sparrowrl"), "status", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120
    )
    assert (
        p.returncode == 1
        and p.stderr.startswith("error: http://127.0.0.1:9/v1/status: ")
        and "Traceback" not in p.stderr
    ), p.stderr
    (tmp_path / "d.spd").write_bytes(b"x")
    p = subprocess.run(
        [str(base / "sparrowrl"), "delta", "inspect", str(tmp_path / "d.spd")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "this command needs the runtime" in p.stderr and "sparrowrl[runtime]" in p.stderr, (
        p.stderr
    )


@pytest.mark.timeout(900)
def test_the_operator_install_is_the_operator_without_torch(tmp_path):
    """What operator/Dockerfile installs (`sparrowrl[operator]`): the operator's modules import,
    and the CRDs it generates are the ones in crds/."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    p = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", f"{ROOT}[operator]"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    code = (
        "import sys; import sparrowrl_operator.handlers, sparrowrl_operator.reconcile; "
        "print(sorted(m for m in ('torch', 'numpy', 'numba') if m in sys.modules))"
    )
    p = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stderr
    p = subprocess.run(
        [str(venv / "bin" / "python"), str(ROOT / "hack" / "gen-crds.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
