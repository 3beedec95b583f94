"""The checks and the listening that the commands which serve or connect share, so that a server
started by hand refuses what a job's role would refuse, in the same words."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from sparrowrl.cli.common import fail, in_range

if TYPE_CHECKING:
    from sparrowrl.transport.http import ServingTLS

MAX_STREAMS = 64
log = logging.getLogger(__name__)


def server_token(host: str, port: int) -> str:
    """The checks every server command makes before it starts anything; returns the token."""
    in_range("--port", port, 1, 65535)
    token = checked_token()
    from sparrowrl.transport.http import is_loopback

    if not token and not is_loopback(host):
        fail(ValueError(f"refusing to serve on non-loopback address {host} without SPARROWRL_TOKEN"))
    return token


def checked_token() -> str:
    """SPARROWRL_TOKEN, or SPARROWRL_TOKEN_FILE's, with the trainer's public key a role token needs."""
    from sparrowrl.auth.credential import Credential
    from sparrowrl.auth.signing import trust

    try:
        token = Credential.from_env().get()
        trust(token)  # a role token comes with the trainer's public key
    except ValueError as e:
        fail(e)
    return token


def trusting(ca_cert: Path | None) -> ssl.SSLContext | None:
    """A TLS context that trusts `ca_cert` alone, read again when it changes (None: the system's)."""
    if not ca_cert:
        return None  # the base install (no aiohttp) gets this far: `status` without --ca-cert
    from sparrowrl.transport.http import TrustedCA

    try:
        return TrustedCA.of(ca_cert)
    except (OSError, ssl.SSLError) as e:  # ssl's message does not name the file
        fail(ValueError(f"--ca-cert {ca_cert}: {e.strerror or e}"))


TLS_CERT_HELP = "PEM certificate: serve HTTPS. Replaced on disk, it serves the next connections (no restart)."
TLS_KEY_HELP = "PEM private key of --tls-cert."


def serving(cert: Path | None, key: Path | None) -> ServingTLS | None:
    """--tls-cert and --tls-key, checked before anything starts (one line, naming the flag)."""
    from sparrowrl.transport.http import tls

    try:
        return tls(cert, key)
    except (ValueError, OSError) as e:
        fail(e)


def listen(app, host: str, port: int, banner: str, ssl_context: ssl.SSLContext | None = None) -> None:
    """Serve `app` until stopped; an address that cannot be bound is one line."""
    from aiohttp import web

    from sparrowrl.transport.http import ListenError

    try:
        web.run_app(
            app,
            host=host,
            port=port,
            ssl_context=ssl_context,
            access_log=None,
            print=lambda _: log.info(banner),
        )
    except OSError as e:
        fail(ListenError.of(host, port, e))
    except ListenError as e:  # the open metrics port
        fail(e)


def ports(local_ports: str | None) -> list[int] | None:
    """--local-ports: one local port per download stream."""
    try:
        found = [int(p) for p in local_ports.split(",")] if local_ports else None
    except ValueError:
        fail(ValueError(f"--local-ports {local_ports!r}: not comma-separated port numbers"))
    if found is not None and len(found) > MAX_STREAMS:
        fail(ValueError(f"--local-ports: {len(found)} ports, one per stream (at most {MAX_STREAMS})"))
    for p in found or []:
        in_range("--local-ports", p, 1, 65535)
    return found
