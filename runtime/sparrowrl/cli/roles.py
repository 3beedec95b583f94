"""A job's roles, one process each: what `sparrowrl run` starts on loopback and what a pod runs.
Each checks its flags and token before it binds or writes anything, so a misconfigured role
exits with one line instead of joining the job."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer
from pydantic import TypeAdapter

from sparrowrl import logs
from sparrowrl.cli.common import LogFormat, LogLevel, fail, in_range
from sparrowrl.cli.net import (
    MAX_STREAMS,
    TLS_CERT_HELP,
    TLS_KEY_HELP,
    checked_token,
    listen,
    ports,
    server_token,
    serving,
    trusting,
)

METRICS_PORT_HELP = (
    "Also serve /metrics here without the token, for a scraper that has none (this port serves nothing else)."
)


def trainer(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file (in a pod: a mounted ConfigMap).")],
    state_dir: Annotated[
        Path, typer.Option(help="Where the trainer keeps its store, metrics and results (in a pod: a volume).")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port: versions, work, status, /healthz, /readyz.")] = 8470,
    metrics_port: Annotated[int | None, typer.Option(help=METRICS_PORT_HELP)] = None,
    tls_cert: Annotated[Path | None, typer.Option(help=TLS_CERT_HELP)] = None,
    tls_key: Annotated[Path | None, typer.Option(help=TLS_KEY_HELP)] = None,
    node: Annotated[
        int, typer.Option(help="This pod's node of a trainer of several (trainer.nodes); node 0 serves.")
    ] = 0,
    rendezvous: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT where the nodes meet: node 0's address (node 0 listens on the port). "
            "Needed with trainer.nodes above 1."
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="CPU threads per rank (default: this machine's cores / trainer.ranks).")
    ] = None,
    log_format: LogFormat = "text",
    log_level: LogLevel = "info",
) -> None:
    """The trainer of a job: GRPO steps, the checkpoint store and its server, the coordinator.
    Started again on the same --state-dir, it goes on from its newest checkpoint. The job's
    secret comes from SPARROWRL_TOKEN: the trainer signs every version with the key it derives.
    A trainer of several nodes runs this on each, with --node and --rendezvous; nodes other than
    0 serve nothing and need no token."""
    import asyncio

    from sparrowrl.auth.signing import TOKEN_PREFIX
    from sparrowrl.spec.job import JobError, load
    from sparrowrl.trainer import preflight
    from sparrowrl.trainer.rendezvous import Gang, GangError
    from sparrowrl.trainer.trainer import serve

    in_range("--threads", threads, 1, 4096)
    try:
        j = load(job)
        gang = Gang.of(j.spec, node, rendezvous, threads, host)
    except (JobError, GangError) as e:
        fail(e)
    if node > 0:
        _node(j.spec, state_dir, gang, log_format, log_level)
        return
    token = server_token(host, port)
    if token.startswith(TOKEN_PREFIX):
        fail(ValueError("the trainer signs versions: SPARROWRL_TOKEN must be the job's secret, not a role token"))
    in_range("--metrics-port", metrics_port, 1, 65535)
    served = serving(tls_cert, tls_key)

    def check() -> None:
        preflight.check(j.spec, str(job), state_dir)

    import socket

    from sparrowrl.transport.http import ListenError

    try:
        with socket.create_server((host, port)):  # before the state dir is written: the address is free
            pass
    except OSError as e:
        fail(ListenError.of(host, port, e))
    from sparrowrl.store.store import StoreError
    from sparrowrl.trainer.hub import HubError
    from sparrowrl.trainer.resume import ResumeError

    logs.setup(log_format, log_level)
    try:
        asyncio.run(serve(j.spec, state_dir, host, port, token, metrics_port, check, served, gang))
    except (JobError, ListenError, ResumeError, StoreError, HubError, GangError) as e:  # the port taken meanwhile; a
        fail(e)  # state dir not to resume; what the hub did not give; nodes that did not join
    if gang.world > 1:
        from sparrowrl.trainer import ranks

        ranks.leave()


def _node(spec, state_dir: Path, gang, log_format: LogFormat, log_level: LogLevel) -> None:
    """Node 1.. of a trainer: its ranks, each making rank 0's calls, until rank 0 says stop."""
    from sparrowrl.store.store import StoreError
    from sparrowrl.trainer import ranks
    from sparrowrl.trainer.hub import HubError
    from sparrowrl.trainer.learner import follow
    from sparrowrl.trainer.rendezvous import GangError
    from sparrowrl.trainer.resume import ResumeError

    logs.setup(log_format, log_level)
    try:
        follow(spec, state_dir, gang)
    except (ResumeError, StoreError, HubError, GangError) as e:
        fail(e)
    ranks.leave()


def relay(
    upstream: Annotated[str, typer.Option(help="Origin (or upper relay) URL; several, comma-separated.")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8471,
    cache: Annotated[Path | None, typer.Option(help="Mirror folder (default: a temporary one).")] = None,
    keep: Annotated[int, typer.Option(help="Versions to keep.")] = 8,
    streams: Annotated[int, typer.Option(help="Parallel HTTP streams to the upstream.")] = 4,
    ca_cert: Annotated[Path | None, typer.Option(help="CA bundle to trust for an HTTPS upstream.")] = None,
    local_ports: Annotated[
        str | None,
        typer.Option(help="Comma-separated local ports for the upstream streams (per-flow shaped links, hack/wan)."),
    ] = None,
    rate_mbit: Annotated[float | None, typer.Option(help="Cap on the download rate from upstream.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help=METRICS_PORT_HELP)] = None,
    tls_cert: Annotated[Path | None, typer.Option(help=TLS_CERT_HELP)] = None,
    tls_key: Annotated[Path | None, typer.Option(help=TLS_KEY_HELP)] = None,
    log_format: LogFormat = "text",
    log_level: LogLevel = "info",
) -> None:
    """Serve a region: fetch each version once from UPSTREAM, serve it with the origin's API."""
    from sparrowrl.transport.relay import Relay, make_relay_app

    token = server_token(host, port)
    in_range("--keep", keep, 1, 1_000_000)
    in_range("--metrics-port", metrics_port, 1, 65535)
    in_range("--streams", streams, 1, MAX_STREAMS)
    in_range("--rate-mbit", rate_mbit, 1e-6, 1e6)
    local = ports(local_ports)
    ctx = trusting(ca_cert)
    served = serving(tls_cert, tls_key)
    logs.setup(log_format, log_level)
    with tempfile.TemporaryDirectory(prefix="sparrowrl-relay-") as tmp:
        try:
            r = Relay(
                upstream.split(","),
                cache or Path(tmp),
                keep=keep,
                streams=streams,
                ssl_context=ctx,
                local_ports=local,
                rate_mbit=rate_mbit,
            )
        except ValueError as e:
            fail(e)
        listen(
            make_relay_app(r, token, None if metrics_port is None else (host, metrics_port), served),
            host,
            port,
            f"relay for {upstream} on {'https' if served else 'http'}://{host}:{port}/v1/versions",
            served.context if served else None,
        )


def worker(
    trainer: Annotated[
        str, typer.Option(help="The trainer's URL: work, results, commits, and versions when the relay has none.")
    ],
    name: Annotated[
        str, typer.Option(help="This worker's name, unique in the job (in a pod: its name).", envvar="POD_NAME")
    ],
    relay: Annotated[str | None, typer.Option(help="The region's relay URL: versions come from it first.")] = None,
    host: Annotated[str, typer.Option(help="Address for /healthz and /readyz.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port for /healthz and /readyz.")] = 8472,
    rate_mbit: Annotated[float | None, typer.Option(help="Cap on this worker's download rate.")] = None,
    region: Annotated[
        str | None, typer.Option(help="The region this worker is in (shown in the job's status).")
    ] = None,
    metrics_port: Annotated[int | None, typer.Option(help=METRICS_PORT_HELP)] = None,
    local_ports: Annotated[
        str | None,
        typer.Option(help="Comma-separated local ports for the download streams (per-flow shaped links, hack/wan)."),
    ] = None,
    pace_tokens_per_s: Annotated[
        float | None,
        typer.Option(help="Hold generation to this rate (benchmarks: the time a dedicated accelerator would take)."),
    ] = None,
    ca_cert: Annotated[
        Path | None, typer.Option(help="CA bundle to trust for HTTPS to the trainer and the relay.")
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option(help=f"{TLS_CERT_HELP} (/healthz, /readyz, /metrics)")] = None,
    tls_key: Annotated[Path | None, typer.Option(help=TLS_KEY_HELP)] = None,
    log_format: LogFormat = "text",
    log_level: LogLevel = "info",
) -> None:
    """A rollout worker. It needs only the network: the job, the model's config and tokenizer and
    its weights all come from the trainer (and the relay). Its token comes from SPARROWRL_TOKEN, the
    trainer's public key from SPARROWRL_TRAINER_KEY: every version is checked against it."""
    import asyncio

    from sparrowrl.spec.messages import Name, Region
    from sparrowrl.worker.worker import main

    in_range("--port", port, 1, 65535)
    in_range("--metrics-port", metrics_port, 1, 65535)
    in_range("--rate-mbit", rate_mbit, 1e-6, 1e6)
    in_range("--pace-tokens-per-s", pace_tokens_per_s, 1e-3, 1e9)
    local = ports(local_ports)
    ctx = trusting(ca_cert)
    served = serving(tls_cert, tls_key)
    for flag, value, kind, rule in (
        ("--name", name, Name, "1..253 of [-A-Za-z0-9_.], starting with a letter or digit"),
        ("--region", region, Region, "a DNS label (lower-case letters, digits, -)"),
    ):
        try:
            if value is not None:
                TypeAdapter(kind).validate_python(value)
        except ValueError:
            fail(ValueError(f"{flag} {value!r}: {rule}"))
    from sparrowrl.transport.failover import FetchError
    from sparrowrl.transport.http import ListenError

    checked_token()
    logs.setup(log_format, log_level)
    try:
        asyncio.run(
            main(
                trainer, relay, name, host, port, rate_mbit, region, metrics_port, local, pace_tokens_per_s, ctx, served
            )
        )
    except (ListenError, FetchError) as e:
        fail(e)
