"""Servers for transport tests: the app on a real loopback socket, or the CLI as a process."""

import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web

from sparrowrl.auth.signing import Signer
from sparrowrl.store.store import Store
from sparrowrl.transport.server import make_app
from support.tensors import mutated
from support.wait import listening, until

TOKEN = "t0ken-for-tests"
EXE = Path(sys.executable).parent / "sparrowrl"


async def listen(app: web.Application, port: int = 0) -> tuple[web.AppRunner, str]:
    """`app` on 127.0.0.1:`port` (0: a free one), in this event loop: its runner, to clean up, and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@asynccontextmanager
async def serving(app: web.Application):
    """`app` on a real loopback socket, in this test's event loop; yields its URL."""
    runner, url = await listen(app)
    try:
        yield url
    finally:
        await runner.cleanup()


class Server:
    """The app on a real loopback socket, in this test's event loop."""

    def __init__(self, store, token=TOKEN, port=0):
        self.store, self.token, self.port = store, token, port

    async def __aenter__(self):
        app = make_app(self.store, self.token, signer=Signer(self.token) if self.token else None)
        self.runner, self.url = await listen(app, self.port)
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


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
    until(lambda: listening(port), 60, f"sparrowrl serve on port {port}", every=0.1, alive={"serve": p})
    return p


def next_version(history, tmp_path, rng) -> tuple:
    """A private copy of the history store, its newest version and state, and a next state."""
    path = tmp_path / "s"
    shutil.copytree(history[0], path)
    store = Store(path)
    v0 = store.newest
    old = store.materialize(v0)
    return path, store, v0, old, mutated(rng, old, 0.02)


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


def get(url: str) -> int:
    """The status of a GET (an error status too); 0 when nothing answers, as before a server listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0
