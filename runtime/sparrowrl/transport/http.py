"""What every role's HTTP server shares: who a bearer token names and what it may do, listening
with an error in one line, health probes, TLS, and what a long-lived server process needs of
its host (open files, a heap the collector leaves alone)."""

from __future__ import annotations

import gc
import ipaddress
import logging
import os
import resource
import ssl
from pathlib import Path
from typing import Callable

from aiohttp import web

from sparrowrl.auth.tokens import ADMIN, Gate, Principal, allowed
from sparrowrl.spec.limits import open_regular

log = logging.getLogger(__name__)

OPEN = frozenset({"/healthz", "/readyz"})  # probes (a kubelet's) carry no token, and these say nothing else
GATE = web.AppKey[Gate | None]("gate")  # None: no token, an open (loopback) server
PRINCIPAL = web.RequestKey("principal", Principal)  # who the request's token names


@web.middleware
async def auth(request: web.Request, handler):
    """Who the bearer token names (`request[PRINCIPAL]`), and whether that role may do this."""
    gate: Gate | None = request.app[GATE]
    if gate is None or request.path in OPEN:
        request[PRINCIPAL] = ADMIN
        return await handler(request)
    who = gate.principal(request.headers.get("Authorization", ""))  # non-UTF-8 bytes arrive surrogate-escaped
    if who is None:
        raise web.HTTPUnauthorized(
            text="missing or wrong bearer token", headers={"WWW-Authenticate": 'Bearer realm="sparrowrl"'}
        )
    if (why := allowed(who, request.method, request.path)) is not None:
        raise web.HTTPForbidden(text=why)
    request[PRINCIPAL] = who
    return await handler(request)


class ListenError(Exception):
    """The address cannot be bound (in use, not this host's, a privileged port)."""

    @classmethod
    def of(cls, host: str, port: int, e: OSError) -> "ListenError":
        # asyncio's message repeats the address; the errno says why
        why = os.strerror(e.errno) if e.errno is not None and e.errno > 0 else e.strerror
        return cls(f"cannot listen on {host}:{port}: {why}")


async def listen(runner: web.AppRunner, host: str, port: int) -> None:
    """Start `runner` on host:port; ListenError in one line if that address cannot be had."""
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as e:
        raise ListenError.of(host, port, e) from None


def add_health(app: web.Application, ready: Callable[[], bool]) -> None:
    """/healthz: the process serves; /readyz: it does its job (`ready()`), 503 until then."""

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_request: web.Request) -> web.Response:
        return web.Response(text="ready") if ready() else web.Response(status=503, text="not ready")

    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz)])


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):  # ssl's own error does not say which
        try:
            open_regular(path, "a PEM file").close()
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ValueError(
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key ({e})"
        ) from None
    return ctx


def more_open_files(who: str) -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit, and say so; (before,
    after). A relay holds a socket per worker's stream and, while a range is sent, the file:
    about 8 descriptors per worker at 4 streams (hack/scale_relay.py: 1,036 at 128 workers); a
    trainer holds a long poll per worker. A soft limit of 1024 (a common default, containerd 2's
    among them) then runs out: a relay near 120 workers answers 503 (its index unreadable) or
    404 (aiohttp's answer when an open fails), and its workers fall back to the origin across
    the WAN; a trainer refuses workers' connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # a hard limit above what the kernel allows: keep the soft one
            return soft, soft
        log.info(f"{who}: open files limit raised from {soft:,} to {hard:,}")
        return soft, hard
    return soft, soft


def freeze_heap() -> None:
    """Move every object allocated so far (the modules imported, a loaded model) out of the
    cyclic garbage collector's reach, before a server takes requests. A full collection walks
    every object it tracks, on the event loop's thread: in a trainer, 450,000 and more (torch,
    transformers, pydantic), 200-300 ms a pass, every few seconds at a thousand workers, each
    pass a stall of every request in flight. What is frozen is still freed by its reference
    count; only what it later drops in reference cycles is never collected (a few kB)."""
    gc.collect()
    gc.freeze()
