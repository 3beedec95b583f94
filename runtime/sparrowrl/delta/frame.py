"""The delta file: header, chunks, manifest, trailer. Written as a stream, read with every check.

    header   b"SPRWDLTA" | u32 format | u32 length | zstd(json) | sha256(zstd(json))
    chunk*   b"SPCK" | u32 index | u32 body length | sha256(index, length, body) | body (records)
    manifest zstd(json): versions, hashes, tensor table with counts, chunk offsets and digests
             (sha256 of each chunk's bytes as stored, so `curl -r` + `sha256sum` can check one)
    trailer  u64 manifest offset | u64 manifest length | sha256(manifest as stored) | b"SPRWEND1"

Formats 1 and 2 store both JSON documents as they are; on a small model they were a tenth of
the delta.

Per tensor, the header gives name, dtype and shape; the manifest gives the changed count, the
hash change, and the span of chunks holding its records (so a receiver can fetch one tensor).

The header names the base and the tensor table, so a receiver can check fit before any chunk
arrives; each chunk carries its own digest, so it can be verified and staged as it lands; the
manifest, written last, holds the target hash and binds header and chunks together.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from pathlib import Path
from typing import Any, NoReturn, Protocol

import torch
import zstandard

from sparrowrl.delta import schema
from sparrowrl.delta.bitview import dtype_name, itemsize
from sparrowrl.delta.encoder import Encoded, Encoder
from sparrowrl.delta.entropy import Cursor
from sparrowrl.delta.errors import CorruptError, FormatError, MismatchError
from sparrowrl.delta.records import (
    SEGMENT,
    Locate,
    Record,
    decode_record,
    next_record,
)
from sparrowrl.delta.schema import FORMAT_VERSION, READS
from sparrowrl.delta.statehash import format_hash, parse_hash
from sparrowrl.delta.tensors import TensorSpec
from sparrowrl.spec.limits import memory_available, read_bounded

MAGIC = b"SPRWDLTA"
END = b"SPRWEND1"
CHUNK_MAGIC = b"SPCK"
HEAD = struct.Struct("<8sII")
CHUNK = struct.Struct("<4sII32s")
TRAILER = struct.Struct("<QQ32s8s")
CHUNK_BYTES = 1 << 20  # the unit of cut-through and of parallel streams: small enough to pipeline a small delta
_M64 = (1 << 64) - 1
MAX_JSON = 1 << 26  # a header or manifest, unpacked: 64 MiB is a table of about a million tensors
PARSE_COST = 16  # bytes of memory that validating a byte of header or manifest JSON may take (measured ~11)


def pack_json(doc: dict[str, Any], version: int) -> bytes:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=9).compress(raw) if version >= 3 else raw


def unpack_json(stored: bytes | memoryview, version: int) -> bytes:
    """A header or manifest as stored, unpacked. Its declared size is bounded before anything is
    allocated for it (zstd frames carry it, and the library allocates it), also by the memory
    that parsing it would take, since a few hundred KB can declare 64 MiB; and the frame must
    be all there is."""
    if version < 3:
        return bytes(stored)
    stored = bytes(stored)
    try:
        size = zstandard.get_frame_parameters(stored).content_size
        if not 0 < size <= MAX_JSON:  # unknown sizes read as 2**64 - 1
            raise ValueError(f"declares {size} bytes unpacked (bound {MAX_JSON})")
        if size * PARSE_COST > memory_available():
            raise ValueError(f"declares {size} bytes unpacked, more than the memory free here can parse")
        one = zstandard.ZstdDecompressor().decompressobj()  # refuses content other than the declared size
        raw = one.decompress(stored)
    except (zstandard.ZstdError, ValueError) as e:
        raise CorruptError(f"does not unpack: {e}") from None
    if not one.eof or one.unused_data:
        raise CorruptError(
            "does not unpack: its zstd frame "
            + ("is cut short" if not one.eof else f"is followed by {len(one.unused_data)} bytes")
        )
    return raw


class Sink(Protocol):
    """Where a delta is written: a binary file, or what writes and flushes as one does."""

    def write(self, data: bytes, /) -> object: ...

    def flush(self) -> object: ...


class DeltaWriter:
    """Streaming encoder: tensors go in as the trainer has them, chunks go out as soon as full.

    Segments are diffed and encoded by an `Encoder`, here or on a sharded trainer's ranks, and
    written in order. The target hash is the base hash plus the change of every record, so the
    writer never hashes the whole model.
    """

    def __init__(
        self,
        out: Sink,
        tensors: list[TensorSpec],
        *,
        base_version: int,
        base_hash: str,
        target_version: int,
        chunk_bytes: int = CHUNK_BYTES,
        segment: int = SEGMENT,
        version: int = FORMAT_VERSION,
    ):
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise MismatchError("tensor table lists a name twice")
        base_hash = format_hash(parse_hash(base_hash))
        self.encoder = Encoder(tensors, segment, version)
        self.version = version
        self.out, self.tensors, self.segment, self.chunk_bytes = out, tensors, segment, chunk_bytes
        self.ids = {t.name: i for i, t in enumerate(tensors)}
        self.changed = [0] * len(tensors)
        self.hash_delta = [0] * len(tensors)
        self.span: list[list[int]] = [[] for _ in tensors]
        self.done = [False] * len(tensors)
        self.chunks: list[dict[str, Any]] = []
        self.buf: list[bytes] = []
        self.buf_len = 0
        self.buf_records = 0
        self.base_hash, self.base_version, self.target_version = base_hash, base_version, target_version
        self.offset = 0
        header = pack_json(
            {
                "format": version,
                "base_version": base_version,
                "base_hash": base_hash,
                "target_version": target_version,
                "segment_elements": segment,
                "tensors": [[t.name, t.dtype, list(t.shape)] for t in tensors],
            },
            version,
        )
        self.header_sha = hashlib.sha256(header).digest()
        self._write(HEAD.pack(MAGIC, version, len(header)) + header + self.header_sha)

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.offset += len(data)

    def _id(self, name: str) -> int:
        if name not in self.ids:
            raise MismatchError(f"tensor '{name}' is not in the delta's tensor table")
        return self.ids[name]

    def _check_pair(self, name: str, old: torch.Tensor, new: torch.Tensor) -> int:
        tid = self._id(name)
        spec = self.tensors[tid]
        for label, t in (("old", old), ("new", new)):
            if tuple(t.shape) != spec.shape or dtype_name(t.dtype) != spec.dtype:
                raise MismatchError(
                    f"tensor '{name}': {label} is {dtype_name(t.dtype)}{list(t.shape)}, "
                    f"table says {spec.dtype}{list(spec.shape)}"
                )
        if self.done[tid]:
            raise MismatchError(f"tensor '{name}' added twice")
        if old.device != new.device:
            raise MismatchError(f"tensor '{name}': old is on {old.device}, new on {new.device}")
        self.done[tid] = True
        return tid

    def add(self, pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Diff and encode whole tensors, (name, old, new)."""
        for e in self.encoder.encode((self._check_pair(n, old, new), 0, old, new) for n, old, new in pairs):
            self.put(e)

    def add_encoded(self, name: str, ranges: list[tuple[int, int]], records: Iterable[Encoded]) -> None:
        """Tensor `name`, encoded elsewhere (by a sharded trainer's ranks) as element ranges
        (first element, count) that must cover it in order, and their records in that order."""
        tid, at = self._id(name), 0
        spec = self.tensors[tid]
        if self.done[tid]:
            raise MismatchError(f"tensor '{name}' added twice")
        for start, n in ranges:
            if start != at or n < 0:
                raise MismatchError(f"tensor '{name}': a range of {n} elements at {start}, where it goes on at {at}")
            at += n
        if at != spec.numel:
            raise MismatchError(
                f"tensor '{name}': its ranges cover {at} elements, the table's "
                f"{spec.dtype}{list(spec.shape)} has {spec.numel}"
            )
        self.done[tid] = True
        for e in records:
            if e.tensor_id != tid:
                raise MismatchError(f"tensor '{name}': a record of tensor id {e.tensor_id} among its own ({tid})")
            self.put(e)

    def put(self, e: Encoded) -> None:
        """Append one encoded segment (in order: by tensor, then element)."""
        if not e.data:
            return
        if e.version != self.version:
            raise MismatchError(f"a record of format {e.version} for a format {self.version} delta")
        tid = e.tensor_id
        self.changed[tid] += e.changed
        self.hash_delta[tid] = (self.hash_delta[tid] + e.hash_delta) & _M64
        chunk = len(self.chunks)
        self.span[tid] = [self.span[tid][0] if self.span[tid] else chunk, chunk]
        self.buf.append(e.data)
        self.buf_len += len(e.data)
        self.buf_records += 1
        if self.buf_len >= self.chunk_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self.buf:
            return
        body = b"".join(self.buf)
        index = len(self.chunks)
        digest = hashlib.sha256(struct.pack("<II", index, len(body)) + body).digest()
        chunk = CHUNK.pack(CHUNK_MAGIC, index, len(body), digest) + body
        self.chunks.append(
            {
                "offset": self.offset,
                "length": len(chunk),
                "sha256": hashlib.sha256(chunk).hexdigest(),
                "records": self.buf_records,
            }
        )
        self._write(chunk)
        self.out.flush()
        self.buf, self.buf_len, self.buf_records = [], 0, 0

    def close(self) -> dict[str, Any]:
        """Flush, write manifest and trailer; every tensor in the table must have been added."""
        self.encoder.close()
        missing = [t.name for t, d in zip(self.tensors, self.done) if not d]
        if missing:
            raise MismatchError(f"{len(missing)} tensors never added, first: '{missing[0]}'")
        self._flush()
        target = (parse_hash(self.base_hash) + sum(self.hash_delta)) & _M64
        manifest = {
            "format": self.version,
            "base_version": self.base_version,
            "base_hash": self.base_hash,
            "target_version": self.target_version,
            "target_hash": format_hash(target),
            "header_sha256": self.header_sha.hex(),
            "elements": sum(t.numel for t in self.tensors),
            "changed": sum(self.changed),
            "dense_bytes": sum(t.numel * itemsize(t.dtype) for t in self.tensors),
            "tensors": [
                {"changed": c, "hash_delta": format_hash(h), "chunks": span}
                for c, h, span in zip(self.changed, self.hash_delta, self.span)
            ],
            "chunks": self.chunks,
        }
        data = pack_json(manifest, self.version)
        offset = self.offset
        self._write(data + TRAILER.pack(offset, len(data), hashlib.sha256(data).digest(), END))
        self.out.flush()
        manifest["file_bytes"] = self.offset
        return manifest


def write_delta(
    out: Sink,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    base_version: int,
    base_hash: str,
    target_version: int,
    **kw: Any,
) -> dict[str, Any]:
    """Diff two in-memory states with the same tensor table into `out`; returns the manifest."""
    if set(old) != set(new):
        raise MismatchError(f"old and new states hold different tensors: '{sorted(set(old) ^ set(new))[0]}'")
    w = DeltaWriter(
        out,
        [TensorSpec.of(n, t) for n, t in new.items()],
        base_version=base_version,
        base_hash=base_hash,
        target_version=target_version,
        **kw,
    )
    try:
        w.add((n, old[n], new[n]) for n in new)
    finally:
        w.encoder.close()
    return w.close()


class DeltaFile:
    """A delta read fully into memory and checked: framing, format, every digest, the bindings."""

    def __init__(self, data: bytes, source: str = "delta"):
        self.data, self.source = data, source
        self.header = self._read_header()
        self.manifest = self._read_manifest()
        self.tensors = [TensorSpec(n, d, tuple(s)) for n, d, s in self.header["tensors"]]
        self._check_chunks()

    @classmethod
    def open(cls, path: str | Path) -> DeltaFile:
        """A delta file, read whole: refused before reading if it is not a regular file or would
        not fit in the memory free now."""
        try:
            data = read_bounded(path, memory_available(), "a delta")
        except ValueError as e:
            raise FormatError(str(e)) from None
        return cls(data, str(path))

    def _fail(self, cls: type[Exception], msg: str) -> NoReturn:
        raise cls(f"{self.source}: {msg}")

    def _read_header(self) -> dict[str, Any]:
        d = self.data
        if len(d) < HEAD.size or d[:8] != MAGIC:
            self._fail(FormatError, "not a sparrowrl delta (bad magic)")
        _, version, n = HEAD.unpack_from(d)
        if version not in READS:
            self._fail(
                FormatError, f"unsupported format version {version} (this sparrowrl reads {', '.join(map(str, READS))})"
            )
        self.version = version
        end = HEAD.size + n
        if len(d) < end + 32 + TRAILER.size:
            self._fail(FormatError, f"truncated: {len(d)} bytes is shorter than header and trailer")
        raw, digest = d[HEAD.size : end], d[end : end + 32]
        if hashlib.sha256(raw).digest() != digest:
            self._fail(
                CorruptError,
                f"header checksum mismatch: expected {digest.hex()[:16]}, "
                f"bytes hash to {hashlib.sha256(raw).hexdigest()[:16]}",
            )
        self.header_end, self.header_sha = end + 32, digest
        try:
            header = schema.parse(schema.Header, unpack_json(raw, version))
        except (ValueError, CorruptError) as e:
            self._fail(CorruptError, f"header: {e}")
        if header.format != version:
            self._fail(CorruptError, f"header says format {header.format}, the file's first bytes {version}")
        return header.model_dump()

    def _read_manifest(self) -> dict[str, Any]:
        d = self.data
        offset, length, digest, end = TRAILER.unpack_from(d, len(d) - TRAILER.size)
        if end != END:
            self._fail(FormatError, "truncated: end marker missing (incomplete download?)")
        if not self.header_end <= offset <= offset + length == len(d) - TRAILER.size:
            self._fail(CorruptError, f"manifest location {offset}+{length} does not fit the file")
        raw = d[offset : offset + length]
        if hashlib.sha256(raw).digest() != digest:
            self._fail(
                CorruptError,
                f"manifest checksum mismatch: expected {digest.hex()[:16]}, "
                f"bytes hash to {hashlib.sha256(raw).hexdigest()[:16]}",
            )
        try:
            m = schema.parse(schema.Manifest, unpack_json(raw, self.version)).model_dump()
        except (ValueError, CorruptError) as e:
            self._fail(CorruptError, f"manifest: {e}")
        if m["header_sha256"] != self.header_sha.hex():
            self._fail(CorruptError, "manifest belongs to a different header")
        for k in ("format", "base_version", "base_hash", "target_version"):
            if m[k] != self.header[k]:
                self._fail(CorruptError, f"manifest {k} {m[k]!r} differs from header {self.header[k]!r}")
        self.manifest_offset = offset
        return m

    def _check_chunks(self) -> None:
        if len(self.manifest["tensors"]) != len(self.tensors):
            self._fail(CorruptError, "manifest and header list different numbers of tensors")
        for spec, t in zip(self.tensors, self.manifest["tensors"]):
            if t["changed"] > spec.numel:
                self._fail(
                    CorruptError,
                    f"manifest: tensor '{spec.name}' claims {t['changed']} changes of {spec.numel} elements",
                )
        pos = self.header_end
        for i, c in enumerate(self.manifest["chunks"]):
            if c["offset"] != pos or c["length"] < CHUNK.size:
                self._fail(
                    CorruptError, f"chunk {i}: offset/length {c['offset']}+{c['length']} not contiguous at {pos}"
                )
            pos += c["length"]
        if pos != self.manifest_offset:
            self._fail(CorruptError, f"chunks end at {pos} but the manifest starts at {self.manifest_offset}")

    def chunk_body(self, i: int) -> memoryview:
        """Chunk i's records, after checking its header and digest against the manifest."""
        c = self.manifest["chunks"][i]
        magic, index, n, digest = CHUNK.unpack_from(self.data, c["offset"])
        body = memoryview(self.data)[c["offset"] + CHUNK.size : c["offset"] + c["length"]]
        if magic != CHUNK_MAGIC or index != i or n != len(body):
            self._fail(CorruptError, f"chunk {i}: bad chunk header")
        found = hashlib.sha256(memoryview(self.data)[c["offset"] : c["offset"] + c["length"]]).hexdigest()
        if found != c["sha256"]:
            self._fail(
                CorruptError,
                f"chunk {i}: checksum mismatch: manifest says sha256 {c['sha256'][:16]}, bytes hash to {found[:16]}",
            )
        if hashlib.sha256(struct.pack("<II", index, n) + body).digest() != digest:
            self._fail(CorruptError, f"chunk {i}: body does not match the chunk's own digest")
        return body

    def records(
        self,
        pool: ThreadPoolExecutor | None = None,
        then: Callable[[Record], Any] = lambda record: record,
        locate: Locate | None = None,
    ) -> Iterator[Any]:
        """Every record, in file order, or `then(record)` of each; with `pool`, chunks are checked
        and their records decoded and passed to `then` in parallel (the kernels release the GIL),
        and the first failing one's error is raised. Context records find their positions in the
        base through `locate` (records.decode_record)."""
        sizes = [itemsize(t.dtype) for t in self.tensors]
        numels = [t.numel for t in self.tensors]

        def chunk(i: int) -> list[Cursor]:
            cur, out = Cursor(self.chunk_body(i), f"{self.source}: chunk {i}"), []
            while cur.pos < len(cur.buf):
                out.append(next_record(cur, self.version))
            return out

        def record(cur: Cursor) -> Any:
            return then(decode_record(cur, sizes, numels, self.version, locate))

        chunks = range(len(self.manifest["chunks"]))
        if pool is None:
            yield from map(record, chain.from_iterable(map(chunk, chunks)))
            return
        # records flow on across chunks, at most 2 per core decoded ahead of the caller (each holds
        # its changes in memory until the caller takes it)
        pending: deque[Future[Any]] = deque()
        try:
            for cur in chain.from_iterable(pool.map(chunk, chunks)):
                pending.append(pool.submit(record, cur))
                if len(pending) >= 2 * (os.cpu_count() or 1):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()

    # ---- summary for `delta inspect` ----
    def summary(self) -> dict[str, Any]:
        m = self.manifest
        changed = m["changed"]
        return {
            "format": m["format"],
            "base_version": m["base_version"],
            "base_hash": m["base_hash"],
            "target_version": m["target_version"],
            "target_hash": m["target_hash"],
            "tensors": len(m["tensors"]),
            "elements": m["elements"],
            "changed": changed,
            "changed_fraction": changed / m["elements"] if m["elements"] else 0.0,
            "chunks": len(m["chunks"]),
            "payload_bytes": len(self.data),
            "dense_bytes": m["dense_bytes"],
            "bytes_per_changed": len(self.data) / changed if changed else None,
            "ratio_vs_dense": len(self.data) / m["dense_bytes"] if m["dense_bytes"] else None,
        }
