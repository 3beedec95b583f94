"""`sparrowrl store`: a store kept by hand, the one a trainer keeps in its state dir and `serve`
publishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from sparrowrl.cli.common import Out, err, fail, out

if TYPE_CHECKING:  # the runtime's modules are imported where a command needs them: a base install has none
    from sparrowrl.store.store import Store

app = typer.Typer(no_args_is_help=True, help="A store of base snapshots plus delta chains.")


def open_store(path: Path) -> Store:
    from sparrowrl.store.store import Store, StoreError

    try:
        return Store(path)
    except StoreError as e:
        fail(e)


@app.command("init")
def init(
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
        fail(e)
    out.print(f"store {store}: version 0, state hash {s.versions[0].state_hash}")


@app.command("add")
def add(store: Path, new: Path) -> None:
    """Diff NEW against the newest version, append it, print the new version number."""
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import Checkpoint, CheckpointError
    from sparrowrl.store.store import StoreError

    s = open_store(store)
    try:
        with Checkpoint(new) as ck:
            v = s.add(ck.load())
    except (StoreError, CheckpointError, DeltaError) as e:
        fail(e)
    err.print(f"v{v.version}: {v.changed:,} changed, {v.delta_bytes:,} bytes" + (", base snapshot" if v.base else ""))
    print(v.version)


@app.command("materialize")
def materialize(store: Path, version: int, output: Out) -> None:
    """Write VERSION as a safetensors file (base + delta chain, every step hash-checked)."""
    from sparrowrl.delta.errors import DeltaError
    from sparrowrl.store.checkpoint_io import CheckpointError, check_output, save_state
    from sparrowrl.store.store import StoreError

    s = open_store(store)
    try:
        check_output(output)
        state = s.materialize(version)
        save_state(state, output)
    except (StoreError, CheckpointError, DeltaError) as e:
        fail(e)
    out.print(f"wrote {output}: version {version}, state hash {s.versions[version].state_hash}")


@app.command("ls")
def ls(store: Path, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List versions with their hashes, delta sizes and snapshots."""
    s = open_store(store)
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


@app.command("plan")
def plan(
    store: Path,
    to: Annotated[int, typer.Option("--to", help="Target version.")],
    have: Annotated[int | None, typer.Option("--from", help="Version the receiver holds.")] = None,
) -> None:
    """Show the cheapest route (in bytes) from one version to another."""
    from sparrowrl.store.store import StoreError

    s = open_store(store)
    try:
        p = s.plan(have, to)
    except StoreError as e:
        fail(e)
    print(json.dumps(vars(p)))


@app.command("prune")
def prune(store: Path, keep: Annotated[int, typer.Option(help="Keep the newest N versions reachable.")]) -> None:
    """Remove versions that no longer serve the newest KEEP."""
    from sparrowrl.store.store import StoreError

    s = open_store(store)
    try:
        removed = s.prune(keep)
    except StoreError as e:
        fail(e)
    out.print(f"removed {len(removed)} versions" + (f" (v{removed[0]}..v{removed[-1]})" if removed else ""))
