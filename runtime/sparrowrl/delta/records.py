"""One record = the changes of one segment (a bounded run of elements) of one tensor.

    header  tensor id, kind, position codec, value codec, start, length, changed count,
            position bytes, value bytes: LEB128 but for the three u8, ~14 bytes (format 3);
            <I B B B x Q Q Q I I>, 40 bytes, in formats 1 and 2
    body    position stream, value stream

Context records (formats 2 and 3) code each change as its class (the base element's exponent,
`context`) and the gap to the class's previous change, counted in that class's own elements;
the zigzagged wrap-around differences of the bit patterns follow in class order, and each class
has models of its own for both. Sparse records (format 1, still read) code gaps between positions
and the differences with one model each. Dense records (chosen when smaller) carry the
difference of every element.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sparrowrl.delta import entropy, kernels
from sparrowrl.delta.bitview import UINT
from sparrowrl.delta.errors import CorruptError
from sparrowrl.delta.extract import zigzag

SPARSE = 1  # record kinds
DENSE = 2
CONTEXT = 3
ANS = 1  # stream codecs
ZSTD = 2
RAW = 3
_HEAD = struct.Struct("<IBBBxQQQII")  # formats 1 and 2
SEGMENT = 1 << 22  # elements a record covers, written
MAX_SEGMENT = 1 << 24


def _pack_head(version: int, *fields: int) -> bytes:
    if version < 3:
        return _HEAD.pack(*fields)
    tid, kind, pos_codec, val_codec, *rest = fields
    out = bytearray()
    entropy.write_varint(out, tid)
    out += bytes((kind, pos_codec, val_codec))
    for f in rest:
        entropy.write_varint(out, f)
    return bytes(out)


def _read_head(cur: entropy.Cursor, version: int) -> tuple[int, ...]:
    if version < 3:
        return cur.unpack(_HEAD.format)
    tid = cur.varint()  # each field is bounded by the checks of decode_record
    kind, pos_codec, val_codec = cur.take(3)
    return (tid, kind, pos_codec, val_codec, *(cur.varint() for _ in range(5)))


@dataclass
class Record:
    tensor_id: int
    start: int
    length: int
    count: int
    positions: np.ndarray | None  # int64, relative to start; None for dense records
    diffs: np.ndarray  # zigzagged differences (unsigned, the tensor's item size)


@dataclass
class Changes:
    """One segment's changes, on the host: what the encoder and the hash update need."""

    start: int
    length: int
    positions: np.ndarray  # int64, relative to start, sorted
    old: np.ndarray  # bit patterns before, at positions
    new: np.ndarray  # bit patterns after, at positions
    classes: np.ndarray  # u8, each change's class in the base (`context`)
    ranks: np.ndarray  # int64, each change's rank among the segment's elements of its class
    dense: Callable[[], np.ndarray]  # zigzagged differences of every element, fetched on demand


def extract_segment(start: int, old: np.ndarray, new: np.ndarray, fld: tuple[int, int]) -> Changes:
    """CPU extraction; `sparrowrl.delta.gpu` produces the same Changes from device arrays."""
    return Changes(start, old.shape[0], *kernels.changed(old, new, fld), lambda: zigzag(np, old, new))


def encode_changes(tensor_id: int, ch: Changes, version: int = 3) -> bytes:
    """Entropy-code one segment; b"" when nothing changed. Dense when that is smaller. Format 1's
    sparse records stay writable for the codec benchmark and the tests of their decoder."""
    count = int(ch.positions.shape[0])
    if count == 0:
        return b""
    if version >= 2:
        pos, val = entropy.context_streams(ch.classes, ch.ranks, zigzag(np, ch.old, ch.new))
        kind = CONTEXT
    else:
        k = entropy.rice_k(int(ch.positions[-1]), count)
        q, r, qc, qesc, v, vc, vesc = kernels.symbols(ch.positions, ch.old, ch.new, k, 8 * ch.old.dtype.itemsize)
        pos, val = entropy.ans_gaps(k, q, r, qc, qesc), entropy.ans_values(v, vc, vesc)
        kind = SPARSE
    pos_codec, val_codec = ANS, ANS
    if len(pos) + len(val) > ch.length * ch.old.dtype.itemsize // 8:
        full = ch.dense()
        packed = entropy.zstd_pack(full)
        d_codec, d = (ZSTD, packed) if len(packed) < full.nbytes else (RAW, full.tobytes())
        if len(d) < len(pos) + len(val):
            kind, pos_codec, pos, val_codec, val = DENSE, 0, b"", d_codec, d
    head = _pack_head(version, tensor_id, kind, pos_codec, val_codec, ch.start, ch.length, count, len(pos), len(val))
    return head + pos + val


def next_record(cur: entropy.Cursor, version: int) -> entropy.Cursor:
    """The next record as a cursor of its own, over the same buffer (so that errors name the byte
    where it starts); `cur` moves past it. Records of one chunk then decode in parallel."""
    start = cur.pos
    *_, pos_len, val_len = _read_head(cur, version)
    cur.take(pos_len + val_len)
    one = entropy.Cursor(cur.buf[: cur.pos], cur.what)
    one.pos = start
    return one


Locate = Callable[[int, int, int, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, bool]]


def decode_record(
    cur: entropy.Cursor, itemsizes: list[int], numels: list[int], version: int, locate: Locate | None = None
) -> Record:
    """Decode the next record; every field is checked against the tensor table it claims.
    A context record's positions are found in the base: `locate(tensor id, start, length,
    classes, counts, gaps)` is kernels.class_locate over that segment of the receiver's tensor."""
    where = f"{cur.what}, record at byte {cur.pos}"
    tid, kind, pos_codec, val_codec, start, length, count, pos_len, val_len = _read_head(cur, version)
    if tid >= len(numels):
        raise CorruptError(f"{where}: tensor id {tid} not in the tensor table ({len(numels)} tensors)")
    if not (0 < length <= MAX_SEGMENT and start + length <= numels[tid]):
        raise CorruptError(
            f"{where}: segment [{start}, {start + length}) outside tensor {tid} of {numels[tid]} elements"
        )
    if not 0 < count <= length:
        raise CorruptError(f"{where}: {count} changes in a segment of {length} elements")
    dtype = np.dtype(UINT[itemsizes[tid]]).newbyteorder("<")
    pos_buf, val_buf = cur.take(pos_len), cur.take(val_len)
    if kind == SPARSE and version == 1:  # formats 2 and 3 never write them
        if pos_codec != ANS or val_codec != ANS:
            raise CorruptError(f"{where}: sparse record with codecs {pos_codec}/{val_codec}")
        g = entropy.ans_gaps_decode(pos_buf, count, where)  # each g >= 0 and < 2**52 by construction
        if int(g.max()) >= length:
            raise CorruptError(f"{where}: gap {int(g.max())} beyond segment length {length}")
        positions = np.cumsum(g + 1) - 1
        if positions[-1] >= length:
            raise CorruptError(f"{where}: position {int(positions[-1])} beyond segment length {length}")
        diffs = entropy.ans_values_decode(val_buf, dtype, count, where)
    elif kind == CONTEXT and version >= 2:
        if pos_codec != ANS or val_codec != ANS:
            raise CorruptError(f"{where}: context record with codecs {pos_codec}/{val_codec}")
        if locate is None:
            raise ValueError("a context record decodes against its base: pass `locate`")
        classes, counts, gaps, in_class = entropy.context_decode(pos_buf, val_buf, dtype, count, length, where)
        positions, src, found = locate(tid, start, length, classes, counts, gaps)
        if not found:
            raise CorruptError(
                f"{where}: a change lies beyond its class's elements in this base (not the base the "
                f"delta was made from?)"
            )
        diffs = in_class[src]
    elif kind == DENSE:
        if pos_len or pos_codec:
            raise CorruptError(f"{where}: dense record with a position stream")
        positions = None
        if val_codec == ZSTD:
            diffs = entropy.zstd_unpack(val_buf, dtype, length, where)
        elif val_codec == RAW and len(val_buf) == length * dtype.itemsize:
            diffs = np.frombuffer(val_buf, dtype).copy()
        else:
            raise CorruptError(f"{where}: unknown value codec {val_codec} or wrong raw length")
    else:
        raise CorruptError(f"{where}: unknown record kind {kind}")
    diffs = diffs.astype(dtype.newbyteorder("="), copy=False)
    if positions is not None and not diffs.all():
        raise CorruptError(f"{where}: a listed change has a zero difference")
    if positions is None and int(np.count_nonzero(diffs)) != count:
        raise CorruptError(
            f"{where}: dense record changes {int(np.count_nonzero(diffs))} elements, header says {count}"
        )
    return Record(tid, start, length, count, positions, diffs)
