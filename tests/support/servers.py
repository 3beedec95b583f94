"""Servers for transport tests: the app on a real loopback socket, or the CLI as a process."""

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from aiohttp import web

from sparrowrl.auth.signing import Signer
from sparrowrl.delta.bitview import bits
from sparrowrl.transport.server import make_app

TOKEN = "t0ken-for-tests"
EXE = Path(sys.executable).parent / "sparrowrl"


def same(a, b):
    return set(a) == set(b) and all(np.array_equal(bits(a[k]), bits(b[k])) for k in a)


@asynccontextmanager
async def serving(app: web.Application):
    """`app` on a real loopback socket, in this test's event loop; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class Server:
    """The app on a real loopback socket, in this test's event loop."""

    def __init__(self, store, token=TOKEN, port=0):
        self.store, self.token, self.port = store, token, port

    async def __aenter__(self):
        self.runner = web.AppRunner(make_app(self.store, self.token, signer=Signer(self.token) if self.token else None))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(store, port, *extra, token=TOKEN):
    env = dict(os.environ, SPARROWRL_TOKEN=token)
    p = subprocess.Popen(
        [str(EXE), "serve", str(store), "--port", str(port), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p
        except OSError:
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.1)
    raise AssertionError("server did not start")


def next_version(history, tmp_path, rng) -> tuple:
    """A private copy of the history store, its newest version and state, and a next state."""
    from conftest import mutate

    from sparrowrl.store.store import Store

    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store = Store(path)
    v0 = store.newest
    old = store.materialize(v0)
    return path, store, v0, old, {k: mutate(rng, t, 0.02) for k, t in old.items()}


def paused_publish(store, old: dict, new: dict, resume, done) -> threading.Thread:
    """A trainer that publishes `new` tensor by tensor and, after the largest tensor's chunks are
    out, waits for `resume` (set by a reader that got a chunk) before encoding the rest."""
    from sparrowrl.delta.tensors import TensorSpec

    def trainer() -> None:
        with store.publish([TensorSpec.of(n, t) for n, t in new.items()]) as w:
            w.chunk_bytes = 256
            names = sorted(new, key=lambda n: -new[n].numel())
            w.add([(names[0], old[names[0]], new[names[0]])])
            resume.wait(30)
            w.add((n, old[n], new[n]) for n in names[1:])
        done.set()

    t = threading.Thread(target=trainer)
    t.start()
    return t


async def until(condition, what: str, seconds: float = 60.0) -> None:
    """Until `condition()` holds; fails naming `what` after `seconds` (a test must not hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, f"after {seconds:g} s: {what}"
        await asyncio.sleep(0.005)


def get(url: str) -> int:
    """The status of a GET (an error status too)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def wait_for(url: str, procs: dict, seconds: float = 240) -> None:
    """Until `url` answers 200 (a readiness probe), while every process in `procs` lives."""
    deadline = time.monotonic() + seconds
    while True:
        dead = {n: p for n, p in procs.items() if p.poll() is not None}
        assert not dead, {n: p.stdout.read()[-5000:] for n, p in dead.items()}
        try:
            if get(url) == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} not ready"
        time.sleep(0.2)
