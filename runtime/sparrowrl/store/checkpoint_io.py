"""Model weights on disk: one safetensors file, or a Hugging Face folder of safetensors shards.

Writes are atomic (a temporary sibling renamed into place), so a failed command leaves no file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparrowrl.delta.bitview import DTYPES, bits, itemsize
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.spec.limits import memory_available


class CheckpointError(Exception):
    """A weights file or folder cannot be read as safetensors."""


class Checkpoint:
    """Read access to a file or shard folder; tensors load one at a time to bound memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.is_dir():
            self.files = sorted(self.path.glob("*.safetensors"))
            if not self.files:
                raise CheckpointError(f"{self.path}: folder holds no *.safetensors files")
            for f in self.files:
                if not f.is_file():  # a FIFO would block the reader forever
                    raise CheckpointError(f"{f}: not a regular file")
        elif self.path.is_file():
            self.files = [self.path]
        else:
            raise CheckpointError(
                f"{self.path}: no such file or folder"
                if not self.path.exists()
                else f"{self.path}: not a regular file or a folder"
            )
        self._stack = ExitStack()
        self.where: dict[str, safe_open] = {}
        self.shard_of: dict[str, str] = {}
        self.metadata: dict[str, dict[str, str]] = {}
        self.specs: list[TensorSpec] = []
        try:
            for f in self.files:
                h = self._stack.enter_context(safe_open(str(f), framework="pt"))
                self.metadata[f.name] = h.metadata() or {}
                for name in h.keys():
                    if name in self.where:
                        raise CheckpointError(f"{self.path}: tensor '{name}' appears in two shards")
                    sl = h.get_slice(name)
                    dtype = sl.get_dtype()
                    if dtype not in DTYPES:
                        raise CheckpointError(f"{f}: tensor '{name}' has unsupported dtype {dtype}")
                    self.where[name], self.shard_of[name] = h, f.name
                    self.specs.append(TensorSpec(name, dtype, tuple(sl.get_shape())))
        except CheckpointError:
            self.close()
            raise
        except Exception as e:  # safetensors raises SafetensorError/OSError on damaged files
            self.close()
            raise CheckpointError(f"{self.path}: not a readable safetensors checkpoint ({e})") from None

    def get(self, name: str) -> torch.Tensor:
        return self.where[name].get_tensor(name)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.specs:
            yield spec.name, self.get(spec.name)

    def load(self) -> dict[str, torch.Tensor]:
        """Every tensor in memory: refused before reading if that is more than is free now."""
        need, free = sum(t.numel * itemsize(t.dtype) for t in self.specs), memory_available()
        if need > free:
            raise CheckpointError(
                f"{self.path}: {need:,} bytes of tensors, more than the {free:,} bytes of memory free here"
            )
        return dict(self.tensors())

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def written_names(source: Path) -> frozenset[str] | None:
    """The names `save_like` writes for a folder checkpoint (its shards and side files); None
    for a single file."""
    return frozenset(f.name for f in source.iterdir() if f.is_file()) if source.is_dir() else None


def check_output(out: Path, names: frozenset[str] | None = None) -> None:
    """Refuse an output that a rename would destroy rather than update: a device, a FIFO, a
    socket, a folder where a file goes; for a folder output (`names`: what will be written
    there), a folder holding anything else. Commands call this before their work, `atomic_path`
    again before its rename."""
    out = out.resolve() if out.is_symlink() else out
    if not out.exists():
        return
    if names is not None:
        if not out.is_dir():
            raise CheckpointError(f"{out}: exists and is not a folder; not replaced")
        other = sorted(e.name for e in out.iterdir() if e.name not in names or not e.is_file())
        if other:
            raise CheckpointError(
                f"{out}: holds '{other[0]}', which this checkpoint does not; not replaced "
                f"(a folder is replaced only by a checkpoint of the same files)"
            )
    elif not out.is_file():
        kind = "a folder" if out.is_dir() else "not a regular file (a device, FIFO or socket)"
        raise CheckpointError(f"{out}: {kind}; not replaced")


@contextmanager
def atomic_path(out: str | Path, names: frozenset[str] | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `out` (a folder when `names` says what it will hold); rename
    it to `out` only if the block succeeds. An output that a rename would destroy is refused
    before the block runs (a symbolic link is followed: its target is replaced)."""
    out = Path(out)
    out = out.resolve() if out.is_symlink() else out
    check_output(out, names)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    target = tmp if names is not None else tmp / out.name
    try:
        yield target
        check_output(out, names)  # again: it may have appeared meanwhile
        if names is not None and out.exists():
            shutil.rmtree(out)
        os.replace(target, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_like(state: dict[str, torch.Tensor], source: Checkpoint, out: str | Path) -> None:
    """Write `state` in the layout of `source`: same shards, metadata and side files (config, tokenizer)."""
    if source.path.is_dir():
        with atomic_path(out, written_names(source.path)) as tmp:
            for f in source.path.iterdir():
                if f.is_file() and f.suffix != ".safetensors":
                    shutil.copy2(f, tmp / f.name)
            for f in source.files:
                part = {n: state[n].contiguous() for n, shard in source.shard_of.items() if shard == f.name}
                save_file(part, str(tmp / f.name), metadata=source.metadata[f.name] or None)
    else:
        with atomic_path(out) as tmp:
            save_file(
                {n: t.contiguous() for n, t in state.items()},
                str(tmp),
                metadata=source.metadata[source.files[0].name] or None,
            )


MAX_HEADER = 100 << 20  # the safetensors format's own bound on its JSON header


def tensors_in(buf) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in `buf`, as views of it: no copy (safetensors'
    `load` copies twice, a third of a 1 GB/s base pull). Every offset is checked against the
    buffer first; a tensor not aligned to its item size (a hand-written file) is copied out.
    `buf`: a writable buffer (bytearray, numpy array) that the tensors keep alive."""
    buf = memoryview(buf).cast("B")
    if len(buf) < 8:
        raise CheckpointError(f"{len(buf)} bytes: too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", buf)
    if n > min(MAX_HEADER, len(buf) - 8):
        raise CheckpointError(f"header of {n:,} bytes in a file of {len(buf):,}")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
    except ValueError as bad:
        raise CheckpointError(f"header is not JSON ({bad})") from None
    if not isinstance(header, dict):
        raise CheckpointError("header is not a JSON object")
    state: dict[str, torch.Tensor] = {}
    ends: list[tuple[int, int]] = []
    start = 8 + n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, size = DTYPES[t["dtype"]]
            shape, (b, e) = [int(x) for x in t["shape"]], [int(x) for x in t["data_offsets"]]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"tensor '{name}': unreadable entry {str(t)[:200]}") from None
        numel = 1
        for x in shape:
            numel *= x
        if min(shape, default=0) < 0 or not 0 <= b <= e <= len(buf) - start or e - b != numel * size:
            raise CheckpointError(f"tensor '{name}': {t['dtype']} {shape} at bytes {b}..{e} of {len(buf) - start}")
        if not numel:
            state[name] = torch.empty(shape, dtype=dtype)
        else:
            view = torch.frombuffer(buf, dtype=dtype, count=numel, offset=start + b).reshape(shape)
            state[name] = view if (start + b) % size == 0 else view.clone()
        ends.append((b, e))
    ends.sort()
    if any(e0 > b1 for (_, e0), (b1, _) in zip(ends, ends[1:])):
        raise CheckpointError("tensors overlap")
    return state


def save_state(state: dict[str, torch.Tensor], out: str | Path) -> None:
    with atomic_path(out) as tmp:
        save_file({n: t.contiguous() for n, t in state.items()}, str(tmp))


def save_stream(
    specs: list[TensorSpec],
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: str | Path,
    verify: Callable[[], None] = lambda: None,
) -> None:
    """A safetensors file written one tensor at a time, in the order of `specs` (which `tensors`
    follows): a sharded trainer gathers one full tensor at a time, never the model. The header
    is the safetensors format's (JSON with each tensor's byte range, padded to 8 bytes); the
    file appears only once whole (`atomic_path`) and `verify` has not raised, so a failure (a
    tensor that does not match its spec, a wrong hash) leaves none."""
    header, at = {}, 0
    for s in specs:
        n = s.numel * itemsize(s.dtype)
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for spec, (name, t) in zip(specs, tensors, strict=True):
            if name != spec.name or TensorSpec.of(name, t) != spec:
                raise CheckpointError(f"{out}: got tensor '{name}' {TensorSpec.of(name, t)}, where {spec} goes")
            f.write(bits(t.cpu()).data)
        verify()
