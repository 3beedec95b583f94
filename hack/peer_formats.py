"""The field's sparse-delta formats, as references for hack/bench_codec.py to measure beside
SparrowRL's own. Each is a pair: `encode(old, new) -> bytes` over two {name: tensor} states, and
`decode_apply(data, state)`, which brings `state` (a copy of old) to new in place. Written here
from each format's published description and code; none of it is product code.

- int32+bf16 (TRL, verl, vime): per changed element an int32 flat index and its new bit
  pattern; applied by index assignment.
- pulse (PULSE, deployed in grail: `grail/infrastructure/sparse_codec.py`, format v3.1): per
  tensor, the changes as COO (row, column) sorted by row, rows as gaps from the row before,
  columns as gaps within a row and absolute where a row starts; each stream in the narrowest
  type its largest value fits (rows uint8/uint16/int32, columns uint16/int32); raw bf16 values;
  a JSON header; zstd level 1 over the whole, single-threaded as grail runs it (threads=0).
- xor+zstd1 (slime): the XOR of new and old bits of every element, dense, zstd level 1 over
  all tensors in order; applied by XOR. No header: both sides hold the tensors' names and sizes.
- additive-bf16 (the published SparrowRL/AuroraRL code): int32 indices and bf16 differences
  `(new.float() - old.float()).bfloat16()`, applied with `index_add_`. Not bit-exact: the
  difference is rounded to bf16, then the sum is rounded again.

Threads: the work per tensor (comparison, gathers, assignment) runs in a pool of one thread per
core, as SparrowRL's codec does; zstd runs on one thread, as the peers ship it.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zstandard

from sparrowrl.delta.bitview import bits

State = Mapping[str, torch.Tensor]
ZSTD_LEVEL = 1


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=os.cpu_count() or 1)


def _pack(meta: list[dict], chunks: Iterable[bytes]) -> bytes:
    """uint32 header length, the JSON header, then the tensors' arrays in header order."""
    header = json.dumps(meta, separators=(",", ":")).encode()
    return struct.pack("<I", len(header)) + header + b"".join(chunks)


def _unpack(data: bytes, sizes: Callable[[dict], list[int]]) -> list[tuple[dict, list[memoryview]]]:
    """Each tensor's header entry with its arrays' bytes, whose lengths `sizes` gives."""
    (n,) = struct.unpack_from("<I", data)
    meta, body, out = json.loads(data[4 : 4 + n]), memoryview(data)[4 + n :], []
    for m in meta:
        parts = []
        for size in sizes(m):
            parts.append(body[:size])
            body = body[size:]
        out.append((m, parts))
    return out


def _changes(old: State, new: State, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices (ascending) and new bit patterns of the elements whose bits differ."""
    a, b = bits(old[name]), bits(new[name])
    idx = np.flatnonzero(a != b)
    return idx, b[idx]


# int32+bf16: index and value per change


def int32_encode(old: State, new: State) -> bytes:
    with _pool() as pool:
        changes = list(pool.map(lambda n: _changes(old, new, n), new))
    meta = [{"name": n, "n": len(idx)} for n, (idx, _) in zip(new, changes) if len(idx)]
    return _pack(meta, (a.tobytes() for idx, vals in changes if len(idx) for a in (idx.astype(np.int32), vals)))


def int32_decode_apply(data: bytes, state: State) -> None:
    def one(entry: tuple[dict, list[memoryview]]) -> None:
        m, (idx, vals) = entry
        flat = bits(state[m["name"]])
        flat[np.frombuffer(idx, np.int32)] = np.frombuffer(vals, flat.dtype)

    tensors = _unpack(data, lambda m: [4 * m["n"], state[m["name"]].element_size() * m["n"]])
    with _pool() as pool:
        list(pool.map(one, tensors))


# pulse: delta-coded COO, narrowest index types, raw values, zstd level 1


def _narrowest(x: np.ndarray, types: tuple[type, ...]) -> np.ndarray:
    top = int(x.max()) if len(x) else 0
    return x.astype(next(t for t in types if top <= np.iinfo(t).max))


def _cols_per_row(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def pulse_encode(old: State, new: State) -> bytes:
    def one(name: str) -> tuple[dict, list[bytes]] | None:
        idx, vals = _changes(old, new, name)
        if not len(idx):
            return None
        rows, cols = np.divmod(idx, _cols_per_row(tuple(new[name].shape)))
        drows = np.diff(rows, prepend=0)
        starts = drows != 0  # a new row: its column is absolute
        starts[0] = True
        dcols = np.where(starts, cols, np.diff(cols, prepend=0))
        drows, dcols = _narrowest(drows, (np.uint8, np.uint16, np.int32)), _narrowest(dcols, (np.uint16, np.int32))
        m = {"name": name, "n": len(idx), "rows": drows.dtype.name, "cols": dcols.dtype.name}
        return m, [drows.tobytes(), dcols.tobytes(), vals.tobytes()]

    with _pool() as pool:
        tensors = [t for t in pool.map(one, new) if t is not None]
    raw = _pack([m for m, _ in tensors], (c for _, chunks in tensors for c in chunks))
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0).compress(raw)


def pulse_decode_apply(data: bytes, state: State) -> None:
    def one(entry: tuple[dict, list[memoryview]]) -> None:
        m, (drows, dcols, vals) = entry
        rows = np.cumsum(np.frombuffer(drows, m["rows"]), dtype=np.int64)
        dcols = np.frombuffer(dcols, m["cols"]).astype(np.int64)
        starts = np.frombuffer(drows, m["rows"]) != 0
        starts[0] = True
        run = np.cumsum(dcols)
        first = np.maximum.accumulate(np.where(starts, np.arange(len(run)), 0))  # where each row's run starts
        cols = run - (run - dcols)[first]
        flat = bits(state[m["name"]])
        flat[rows * _cols_per_row(tuple(state[m["name"]].shape)) + cols] = np.frombuffer(vals, flat.dtype)

    def sizes(m: dict) -> list[int]:
        item = (np.dtype(m["rows"]).itemsize, np.dtype(m["cols"]).itemsize, state[m["name"]].element_size())
        return [k * m["n"] for k in item]

    tensors = _unpack(zstandard.ZstdDecompressor().decompress(data), sizes)
    with _pool() as pool:
        list(pool.map(one, tensors))


# xor+zstd1: dense XOR of the bits, zstd level 1


def xor_encode(old: State, new: State) -> bytes:
    """The next tensor's XOR is computed in the pool while zstd compresses this one's."""
    names, out = list(new), []
    z = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=0).compressobj()
    with _pool() as pool:
        ahead = pool.submit(np.bitwise_xor, bits(old[names[0]]), bits(new[names[0]]))
        for i in range(len(names)):
            x = ahead.result()
            if i + 1 < len(names):
                ahead = pool.submit(np.bitwise_xor, bits(old[names[i + 1]]), bits(new[names[i + 1]]))
            out.append(z.compress(x))
    out.append(z.flush())
    return b"".join(out)


def xor_decode_apply(data: bytes, state: State) -> None:
    """Each tensor's XOR runs in the pool while zstd decompresses the next."""
    reader = zstandard.ZstdDecompressor().stream_reader(data)
    with _pool() as pool:
        done = []
        for t in state.values():
            flat = bits(t)
            x = np.empty_like(flat)
            view, got = memoryview(x).cast("B"), 0
            while got < len(view):
                n = reader.readinto(view[got:])
                if not n:
                    raise ValueError("xor+zstd1: the stream ends before the state does")
                got += n
            done.append(pool.submit(np.bitwise_xor, flat, x, out=flat))
        for f in done:
            f.result()


# additive-bf16: indices and rounded bf16 differences, index_add_


def additive_encode(old: State, new: State) -> bytes:
    def one(name: str) -> tuple[np.ndarray, np.ndarray]:
        idx, _ = _changes(old, new, name)
        at = torch.from_numpy(idx)
        delta = (new[name].reshape(-1)[at].float() - old[name].reshape(-1)[at].float()).bfloat16()
        return idx.astype(np.int32), bits(delta)

    with _pool() as pool:
        changes = list(pool.map(one, new))
    meta = [{"name": n, "n": len(idx)} for n, (idx, _) in zip(new, changes) if len(idx)]
    return _pack(meta, (a.tobytes() for idx, d in changes if len(idx) for a in (idx, d)))


def additive_decode_apply(data: bytes, state: State) -> None:
    def one(entry: tuple[dict, list[memoryview]]) -> None:
        m, (idx, delta) = entry
        t = state[m["name"]]
        d = torch.from_numpy(np.frombuffer(delta, np.int16).copy()).view(t.dtype)
        t.view(-1).index_add_(0, torch.from_numpy(np.frombuffer(idx, np.int32).copy()), d)

    tensors = _unpack(data, lambda m: [4 * m["n"], 2 * m["n"]])
    with _pool() as pool:
        list(pool.map(one, tensors))


FORMATS: dict[str, tuple[Callable[[State, State], bytes], Callable[[bytes, State], None]]] = {
    "int32+bf16": (int32_encode, int32_decode_apply),
    "pulse": (pulse_encode, pulse_decode_apply),
    "xor+zstd1": (xor_encode, xor_decode_apply),
    "additive-bf16": (additive_encode, additive_decode_apply),
}
BIT_EXACT = {"int32+bf16": True, "pulse": True, "xor+zstd1": True, "additive-bf16": False}  # by construction
ABOUT = {
    "int32+bf16": "TRL, verl, vime: int32 flat index + raw bf16 value per change; index assignment",
    "pulse": "PULSE/grail sparse_codec v3.1: delta-coded COO (rows uint8/16/int32, columns uint16/int32), "
    "raw bf16, zstd level 1 single-threaded; index assignment",
    "xor+zstd1": "slime: dense XOR of old and new bits, zstd level 1 single-threaded; XOR back",
    "additive-bf16": "published SparrowRL/AuroraRL: int32 index + bf16(new.float() - old.float()); index_add_",
}
