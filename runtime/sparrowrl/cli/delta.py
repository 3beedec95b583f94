"""`sparrowrl delta`: the codec on files, without a store or a server, to make a delta by hand and
see what one holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sparrowrl.cli.common import Out, err, fail, in_range, out

if TYPE_CHECKING:  # the runtime's modules are imported where a command needs them: a base install has none
    from sparrowrl.store.checkpoint_io import Checkpoint

app = typer.Typer(no_args_is_help=True, help="Make, apply and inspect sparse delta checkpoints.")


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


def _desc(spec) -> str:
    return "no such tensor" if spec is None else f"{spec.dtype}{list(spec.shape)}"


@app.command("diff")
def diff(
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

    in_range("--base-version", base_version, 0, 10**8 - 1)
    in_range("--version", version, 0, 10**8 - 1)
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
        fail(e)
    out.print(
        f"wrote {output}: {m['changed']:,} of {m['elements']:,} elements changed, "
        f"{m['file_bytes']:,} bytes ({m['file_bytes'] / max(m['dense_bytes'], 1):.2%} of dense)"
    )


@app.command("apply")
def apply(base: Path, delta: Path, output: Out) -> None:
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
        fail(e)
    out.print(f"wrote {output}: version {d.manifest['target_version']}, state hash {h} (verified)")


@app.command("inspect")
def inspect(delta: Path, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Versions, hashes, sizes and per-tensor counts of a delta (all checksums are verified)."""
    from sparrowrl.delta import DeltaFile
    from sparrowrl.delta.errors import DeltaError

    try:
        d = DeltaFile.open(delta)
        for i in range(len(d.manifest["chunks"])):
            d.chunk_body(i)
    except (DeltaError, OSError) as e:
        fail(e)
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
