"""`sparrowrl serve` and `sparrowrl fetch`: both ends of the transfer run by hand, outside a job, with
the checks a job's roles make."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from sparrowrl import logs
from sparrowrl.cli.common import LogFormat, LogLevel, Out, fail, in_range, out
from sparrowrl.cli.net import MAX_STREAMS, TLS_CERT_HELP, TLS_KEY_HELP, listen, server_token, serving, trusting
from sparrowrl.cli.store import open_store


def serve(
    store: Path,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8470,
    tls_cert: Annotated[Path | None, typer.Option(help=TLS_CERT_HELP)] = None,
    tls_key: Annotated[Path | None, typer.Option(help=TLS_KEY_HELP)] = None,
    log_format: LogFormat = "text",
    log_level: LogLevel = "info",
) -> None:
    """Publish a checkpoint store over HTTP(S). The job's secret comes from SPARROWRL_TOKEN: it
    admits clients, and signs every version served (clients check with the public key it derives,
    which `sparrowrl credentials key` prints)."""
    from sparrowrl.auth.signing import TOKEN_PREFIX, Signer
    from sparrowrl.transport.server import make_app

    token = server_token(host, port)
    if token.startswith(TOKEN_PREFIX):
        fail(ValueError("serve signs what it publishes: SPARROWRL_TOKEN must be the job's secret, not a role token"))
    open_store(store)
    served = serving(tls_cert, tls_key)
    ctx = served.context if served else None
    logs.setup(log_format, log_level)
    listen(
        make_app(store, token, signer=Signer(token) if token else None),
        host,
        port,
        f"serving {store} on {'https' if ctx else 'http'}://{host}:{port}"
        f"/v1/versions" + ("" if token else " (no token: loopback only)"),
        ctx,
    )


def fetch(
    url: Annotated[str, typer.Argument(help="Server or relay URL; several, comma-separated, for fallback.")],
    version: Annotated[int, typer.Option(help="Version to fetch.")],
    output: Out,
    base: Annotated[Path | None, typer.Option(help="Local weights of --base-version.")] = None,
    base_version: Annotated[int | None, typer.Option(help="Version of --base.")] = None,
    streams: Annotated[int, typer.Option(help="Parallel HTTP streams.")] = 4,
    ca_cert: Annotated[Path | None, typer.Option(help="CA bundle to trust for HTTPS.")] = None,
) -> None:
    """Fetch VERSION by the cheapest route (delta chain from --base, or a base snapshot), verify it
    chunk by chunk and by state hash, and write it to OUT."""
    import asyncio
    import ssl

    from sparrowrl.delta import state_hash
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError, check_output, save_state
    from sparrowrl.transport.client import Client
    from sparrowrl.transport.failover import FetchError

    if (base is None) != (base_version is None):
        fail(ValueError("--base and --base-version go together"))
    in_range("--version", version, 0, 10**8 - 1)
    in_range("--base-version", base_version, 0, 10**8 - 1)
    in_range("--streams", streams, 1, MAX_STREAMS)
    ctx = trusting(ca_cert)
    try:
        check_output(output)
        have = None
        if base is not None and base_version is not None:  # both or neither (above)
            with Checkpoint(base) as ck:
                state = ck.load()
            have = (base_version, state, state_hash(state))

        async def go():
            async with Client(url.split(","), streams=streams, ssl_context=ctx) as c:
                return await c.advance(version, have), c.stats

        (state, h), stats = asyncio.run(go())
        save_state(state, output)
    except (FetchError, DeltaError, CheckpointError, OSError, ssl.SSLError, ValueError) as e:
        fail(e)
    rate = stats.bytes / stats.seconds / 1e6 if stats.seconds else 0.0
    out.print(
        f"wrote {output}: version {version}, state hash {h} (verified); fetched {stats.bytes:,} bytes "
        f"in {stats.seconds:.2f} s ({rate:.1f} MB/s, {streams} streams, {stats.retries} retries, "
        f"{stats.refetched} pieces refetched)"
    )
