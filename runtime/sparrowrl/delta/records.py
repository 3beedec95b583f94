"""One record = the changes of one segment (a bounded run of elements) of one tensor.

    header  <I B B B x Q Q Q I I>  tensor id, kind, position codec, value codec,
                                   start, length, changed count, position bytes, value bytes
    body    position stream, value stream

Sparse records carry gaps between changed positions and the zigzagged wrap-around differences of
their bit patterns. Dense records (chosen when smaller) carry the difference of every element.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np

from sparrowrl.delta import entropy, kernels
from sparrowrl.delta.bitview import UINT
from sparrowrl.delta.errors import CorruptError
from sparrowrl.delta.extract import zigzag

SPARSE = 1  # record kinds
DENSE = 2
ANS = 1  # stream codecs
ZSTD = 2
RAW = 3
_HEAD = struct.Struct("<IBBBxQQQII")
MAX_SEGMENT = 1 << 24


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
    dense: Callable[[], np.ndarray]  # zigzagged differences of every element, fetched on demand


def extract_segment(start: int, old: np.ndarray, new: np.ndarray) -> Changes:
    """CPU extraction; `sparrowrl.delta.gpu` produces the same Changes from device arrays."""
    idx, va, vb = kernels.changed(old, new)
    return Changes(start, old.shape[0], idx, va, vb, lambda: zigzag(np, old, new))


def encode_changes(tensor_id: int, ch: Changes) -> bytes:
    """Entropy-code one segment; b"" when nothing changed. Dense when that is smaller."""
    count = int(ch.positions.shape[0])
    if count == 0:
        return b""
    k = entropy.rice_k(int(ch.positions[-1]), count)
    q, r, qc, qesc, v, vc, vesc = kernels.symbols(ch.positions, ch.old, ch.new, k, 8 * ch.old.dtype.itemsize)
    pos, val = entropy.ans_gaps(k, q, r, qc, qesc), entropy.ans_values(v, vc, vesc)
    kind, pos_codec, val_codec = SPARSE, ANS, ANS
    if len(pos) + len(val) > ch.length * ch.old.dtype.itemsize // 8:
        full = ch.dense()
        packed = entropy.zstd_pack(full)
        d_codec, d = (ZSTD, packed) if len(packed) < full.nbytes else (RAW, full.tobytes())
        if len(d) < len(pos) + len(val):
            kind, pos_codec, pos, val_codec, val = DENSE, 0, b"", d_codec, d
    head = _HEAD.pack(tensor_id, kind, pos_codec, val_codec, ch.start, ch.length, count, len(pos), len(val))
    return head + pos + val


def decode_record(cur: entropy.Cursor, itemsizes: list[int], numels: list[int]) -> Record:
    """Decode the next record; every field is checked against the tensor table it claims."""
    tid, kind, pos_codec, val_codec, start, length, count, pos_len, val_len = cur.unpack(_HEAD.format)
    where = f"{cur.what}, record at byte {cur.pos - _HEAD.size}"
    if tid >= len(numels):
        raise CorruptError(f"{where}: tensor id {tid} not in the tensor table ({len(numels)} tensors)")
    if not (0 < length <= MAX_SEGMENT and start + length <= numels[tid]):
        raise CorruptError(f"{where}: segment [{start}, {start + length}) outside tensor {tid} of {numels[tid]} elements")
    if not 0 < count <= length:
        raise CorruptError(f"{where}: {count} changes in a segment of {length} elements")
    dtype = np.dtype(UINT[itemsizes[tid]]).newbyteorder("<")
    pos_buf, val_buf = cur.take(pos_len), cur.take(val_len)
    if kind == SPARSE:
        if pos_codec != ANS or val_codec != ANS:
            raise CorruptError(f"{where}: sparse record with codecs {pos_codec}/{val_codec}")
        g = entropy.ans_gaps_decode(pos_buf, count, where)  # each g >= 0 and < 2**52 by construction
        if int(g.max()) >= length:
            raise CorruptError(f"{where}: gap {int(g.max())} beyond segment length {length}")
        positions = np.cumsum(g + 1) - 1
        if positions[-1] >= length:
            raise CorruptError(f"{where}: position {int(positions[-1])} beyond segment length {length}")
        n_vals = count
    elif kind == DENSE:
        if pos_len or pos_codec:
            raise CorruptError(f"{where}: dense record with a position stream")
        positions, n_vals = None, length
    else:
        raise CorruptError(f"{where}: unknown record kind {kind}")
    if kind == SPARSE:
        diffs = entropy.ans_values_decode(val_buf, dtype, n_vals, where)
    elif val_codec == ZSTD:
        diffs = entropy.zstd_unpack(val_buf, dtype, n_vals, where)
    elif val_codec == RAW and len(val_buf) == n_vals * dtype.itemsize:
        diffs = np.frombuffer(val_buf, dtype).copy()
    else:
        raise CorruptError(f"{where}: unknown value codec {val_codec} or wrong raw length")
    diffs = diffs.astype(dtype.newbyteorder("="), copy=False)
    if positions is not None and not diffs.all():
        raise CorruptError(f"{where}: a listed change has a zero difference")
    if positions is None and int(np.count_nonzero(diffs)) != count:
        raise CorruptError(f"{where}: dense record changes {int(np.count_nonzero(diffs))} elements, header says {count}")
    return Record(tid, start, length, count, positions, diffs)
