"""Waiting with a deadline: a test waits for something that a thread, a process or a server does,
and must fail, naming what it waited for, rather than hang when that never happens.

`until` polls from a thread (a test's own, or one of the harness's); `until_async` polls from a
coroutine in the test's event loop, which keeps running meanwhile. `listening` is what a test
waits on for a server it started."""

from __future__ import annotations

import asyncio
import inspect
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def until(
    probe: Callable[[], T],
    timeout: float,
    what: str,
    every: float = 0.05,
    alive: Mapping[str, subprocess.Popen] | None = None,
) -> T:
    """The first truthy `probe()`, polled every `every` s; fails naming `what` (and the last value)
    after `timeout` s, or as soon as a process of `alive` (name → process) has exited, with its output."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        _check(alive or {}, what)
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {value!r})")
        time.sleep(every)


async def until_async(probe: Callable[[], T | Awaitable[T]], timeout: float, what: str, every: float = 0.005) -> T:
    """`until` in the test's event loop: the first truthy `probe()` (awaited, if a coroutine
    function), sleeping `every` s between tries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {value!r})")
        await asyncio.sleep(every)


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:`port`: a server started, or not yet."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _check(alive: Mapping[str, subprocess.Popen], what: str) -> None:
    dead = {name: p for name, p in alive.items() if p.poll() is not None}
    if dead:
        said = {n: p.stdout.read()[-5000:] if p.stdout else f"exit {p.returncode}" for n, p in dead.items()}
        raise AssertionError(f"{', '.join(dead)} exited while waiting for {what}: {said}")
