"""Entropy coding of a sparse record's two integer streams, and zstd for dense records.

Both sparse streams use ANS, constriction's stack coder as numba ports that release the GIL
(`kernels.ans_encode`, `kernels.ans_decode`, bit for bit the library's: tests/test_fuzz.py);
symbols at 255 escape to a raw side array. ANS gets within ~1% of the empirical entropy
of its model, which zstd's Huffman stage cannot (measured: zstd of byte-shuffled gaps and
differences costs ~12% more per changed element, and never won a stream on realistic or
real-training steps).
Positions use a Rice split: gap = q * 2**k + r, q by ANS, r as k raw bits (packed by a GIL-free
kernel; ANS would spend the same bits, slower). For geometric gaps q and r are independent, so
the split loses nothing.

Context records (formats 2 and 3) code each class of elements with its own parametric models
(`context_streams`); format 1's sparse records, still read, code all elements alike with one
categorical model per stream whose symbol counts travel with it.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import zstandard
from numpy.typing import DTypeLike

from sparrowrl.delta import kernels
from sparrowrl.delta.errors import CorruptError

_ALPHABET = 256  # symbols 0..254 literal, 255 = escape
_MAX_K = 20
_ZLEVEL = 3


class Cursor:
    """Bounds-checked reads from a record body; overruns are corruption, not IndexError."""

    def __init__(self, buf: bytes | memoryview, what: str):
        self.buf = memoryview(buf)
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CorruptError(
                f"{self.what}: truncated (needs {n} bytes at offset {self.pos}, has {len(self.buf) - self.pos})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype: DTypeLike, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(dt.itemsize * count), dtype=dt).copy()

    def varint(self) -> int:
        """One LEB128 integer, below 2**63: at most 9 bytes, and in its shortest form (so that one
        record has one encoding)."""
        v, shift = 0, 0
        while True:
            (byte,) = self.take(1)
            v |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
            if shift > 56:
                raise CorruptError(f"{self.what}: integer at offset {self.pos} longer than 9 bytes")
        if byte == 0 and shift:
            raise CorruptError(f"{self.what}: integer at offset {self.pos} not in its shortest form")
        return v

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise CorruptError(f"{self.what}: {len(self.buf) - self.pos} trailing bytes")


# ---- shuffled zstd -------------------------------------------------------------------------


def _shuffle(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a.view(np.uint8).reshape(-1, a.dtype.itemsize).T).tobytes()


def zstd_pack(a: np.ndarray) -> bytes:
    return zstandard.ZstdCompressor(level=_ZLEVEL).compress(_shuffle(a))


def zstd_unpack(buf: bytes | memoryview, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    dt = np.dtype(dtype)
    size = dt.itemsize * count
    try:
        declared = zstandard.get_frame_parameters(bytes(buf)).content_size
        if declared != size:  # checked before decompressing: a forged size must not allocate
            raise CorruptError(f"{what}: zstd frame declares {declared} bytes, expected {size}")
        raw = zstandard.ZstdDecompressor().decompress(bytes(buf), max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptError(f"{what}: zstd stream does not decode ({e})") from None
    if len(raw) != size:
        raise CorruptError(f"{what}: zstd stream holds {len(raw)} bytes, expected {size}")
    return np.ascontiguousarray(np.frombuffer(raw, np.uint8).reshape(dt.itemsize, count).T).view(dt).reshape(count)


# ---- ANS ---------------------------------------------------------------------------------


def _cdfs(weights: list[np.ndarray]) -> np.ndarray:
    return np.stack([kernels.ans_cdf(w) for w in weights])


def _encode_runs(sym: np.ndarray, counts: np.ndarray, weights: list[np.ndarray]) -> bytes:
    """ANS words of `sym`, a run of counts[j] symbols per model weights[j]; run 0 decodes first."""
    return kernels.ans_encode(sym, _cdfs(weights), counts).astype("<u4").tobytes()


def _decode_runs(words: memoryview, counts: np.ndarray, weights: list[np.ndarray], what: str) -> np.ndarray:
    """The symbols of one ANS stack, run by run, which must then be exactly empty
    (`kernels.ans_decode`, which releases the GIL, so that a delta's records decode in parallel)."""
    if len(words) % 4:
        raise CorruptError(f"{what}: ANS words not a multiple of 4 bytes")
    cdfs = _cdfs(weights)
    out, status = kernels.ans_decode(np.frombuffer(words, "<u4").astype(np.uint32), cdfs, counts)
    if status == 2:
        raise CorruptError(f"{what}: ANS stream does not decode (its last word is zero)")
    if status:
        raise CorruptError(f"{what}: ANS stream has undecoded bits left")
    return out


def _trim(counts: np.ndarray) -> np.ndarray:
    """The model's table: up to the last used symbol, at least 2 long (constriction's minimum).
    The decoder rebuilds exactly this array from the sparse table, so both build the same model."""
    used = np.flatnonzero(counts)
    return counts[: max(int(used[-1]) + 1 if len(used) else 0, 2)]


def _write_counts(counts: np.ndarray) -> bytes:
    """Sparse symbol table: u16 n, n symbols (u8), n LEB128 counts. Typically ~100 bytes."""
    sym = np.flatnonzero(counts)
    out = bytearray(struct.pack("<H", len(sym)))
    out += sym.astype(np.uint8).tobytes()
    for c in counts[sym].tolist():
        write_varint(out, c)
    return bytes(out)


def _read_counts(cur: Cursor) -> np.ndarray:
    (n,) = cur.unpack("<H")
    if not 1 <= n <= _ALPHABET:
        raise CorruptError(f"{cur.what}: symbol table size {n} out of range")
    sym = cur.array(np.uint8, n).astype(np.int64)
    if n > 1 and (np.diff(sym) <= 0).any():
        raise CorruptError(f"{cur.what}: symbol table not strictly increasing")
    counts = np.zeros(max(int(sym[-1]) + 1, 2), dtype=np.int64)
    for s in sym.tolist():
        counts[s] = _read_count(cur)
    return counts


def write_varint(out: bytearray, c: int) -> None:
    """LEB128: 7 bits a byte, low first (`Cursor.varint` and `_read_count` read it)."""
    while c >= 0x80:
        out.append((c & 0x7F) | 0x80)
        c >>= 7
    out.append(c)


def _read_count(cur: Cursor) -> int:
    """One LEB128 count of at most 6 bytes: at least 1 and below 2**42 (callers bound it further)."""
    c, shift = 0, 0
    while True:
        (byte,) = cur.take(1)
        c |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            break
        if shift > 35:
            raise CorruptError(f"{cur.what}: count too long")
    if c == 0:
        raise CorruptError(f"{cur.what}: zero count")
    return c


def _pack(sym: np.ndarray, counts: np.ndarray, esc: np.ndarray, esc_dtype: str, middle: bytes = b"") -> bytes:
    """table | u32 n_esc | escapes | middle | ANS words of the symbols."""
    counts = _trim(counts)
    return b"".join(
        [
            _write_counts(counts),
            struct.pack("<I", len(esc)),
            esc.astype(esc_dtype).tobytes(),
            middle,
            _encode_runs(sym, np.array([len(sym)], np.int64), [counts]),
        ]
    )


def _unpack(cur: Cursor, count: int, esc_dtype: str, middle_len: int, out_dtype: str) -> tuple[np.ndarray, memoryview]:
    """Inverse of _pack: the symbols with escapes substituted (as out_dtype), and the middle."""
    what = cur.what
    counts = _read_counts(cur)
    if int(counts.sum()) != count:
        raise CorruptError(f"{what}: symbol table counts {int(counts.sum())} symbols, expected {count}")
    (n_esc,) = cur.unpack("<I")
    if n_esc > count:
        raise CorruptError(f"{what}: {n_esc} escapes for {count} symbols")
    esc = cur.array(esc_dtype, n_esc)
    middle = cur.take(middle_len)
    sym = _decode_runs(cur.take(len(cur.buf) - cur.pos), np.array([count], np.int64), [counts], what)
    return _substitute(sym, esc, what).astype(out_dtype), middle


def ans_values(sym: np.ndarray, counts: np.ndarray, esc: np.ndarray) -> bytes:
    """Value stream: table | n_esc | escapes (item size each) | ANS words."""
    return _pack(sym, counts, esc, esc.dtype.newbyteorder("<").str)


def ans_values_decode(buf: memoryview, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    le = np.dtype(dtype).newbyteorder("<").str
    return _unpack(Cursor(buf, what), count, le, 0, le)[0]


def rice_k(last: int, count: int) -> int:
    """Rice parameter from the mean gap: 2**k about a quarter to an eighth of it, so r is near
    uniform (coding it raw loses ~0.01 bit) while q stays small (mean ~4-8, escapes rare)."""
    return int(_rice_ks(np.array([last]), np.array([count]))[0])


def _rice_ks(last: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """rice_k for many classes at once: their largest rank and their count of changes."""
    mean = (last + 1 - counts) / counts
    ks: np.ndarray = np.clip(np.floor(np.log2(mean + 1.0)) - 2, 0, _MAX_K).astype(np.uint8)
    return ks


def ans_gaps(k: int, q: np.ndarray, r: np.ndarray, counts: np.ndarray, esc: np.ndarray) -> bytes:
    """Position stream: u8 k | table(q) | n_esc | escapes (u32) | r (k bits each) | ANS words (q)."""
    low = kernels.pack_bits(r, np.full(len(r), k, np.int64))
    return struct.pack("<B", k) + _pack(q, counts, esc, "<u4", low.tobytes())


def ans_gaps_decode(buf: memoryview, count: int, what: str) -> np.ndarray:
    cur = Cursor(buf, what)
    (k,) = cur.unpack("<B")
    if k > _MAX_K:
        raise CorruptError(f"{what}: Rice parameter {k} out of range")
    q, low = _unpack(cur, count, "<u4", (count * k + 7) // 8, "<i8")
    g: np.ndarray = q << k
    if k:
        g |= kernels.unpack_bits(np.frombuffer(low, np.uint8), np.full(count, k, np.int64))
    return g


# ---- context streams (formats 2 and 3) ------------------------------------------------------
#
# Each class has its own models, given by parameters instead of symbol tables: a record of a
# small tensor holds a few thousand changes over ~20 classes, and tables would cost more than
# the context saves. Within a class, changes are close to independent with one probability, so
# gaps are geometric: q (the gap's quotient by 2**k) is coded with a geometric model of ratio
# t_q / 256, r as k raw bits. Values are the magnitude of the step in ULPs (geometric, ratio
# t_v / 256) with either sign alike, and an escape for the rest, as often as e / 256 says.

_GEOMETRIC = np.zeros((256, _ALPHABET), np.int64)  # [t, i]: weight of i under ratio t / 256
_GEOMETRIC[:, 0] = 1 << 24
for _i in range(1, _ALPHABET):
    _GEOMETRIC[:, _i] = _GEOMETRIC[:, _i - 1] * np.arange(256) >> 8
_STEP = (np.arange(1, _ALPHABET - 1) + 1) // 2 - 1  # value symbol z (1..254) -> ULPs - 1 of its step


def _gap_weights(t: int) -> np.ndarray:
    w: np.ndarray = _GEOMETRIC[t]
    return w


def _value_weights(t: int, e: int) -> np.ndarray:
    w = np.zeros(_ALPHABET, np.int64)
    w[1 : _ALPHABET - 1] = _GEOMETRIC[t, _STEP]
    w[_ALPHABET - 1] = int(w.sum()) * e >> 8
    return w


def _ratio(mean: np.ndarray) -> np.ndarray:
    """The u8 parameter t of a geometric model with this mean: t / 256 = mean / (1 + mean)."""
    t: np.ndarray = np.clip(np.rint(256 * mean / (1 + mean)), 0, 255).astype(np.uint8)
    return t


def context_streams(classes: np.ndarray, ranks: np.ndarray, z: np.ndarray) -> tuple[bytes, bytes]:
    """The position and value streams of a context record, from each change's class, its rank
    in its class, and its zigzagged difference (all in position order).

    positions: u8 first class | u8 span - 1 | bitmap of the classes present (span bits)
               | n × u8 k | n × u8 t_q | n × u8 t_v | n × u8 e | n × LEB128 count
               | u32 n_esc | u32 × n_esc (q >= 255) | r bits | ANS(q, class by class)
    values:    u32 n_esc | item × n_esc (z >= 255) | ANS(z, class by class)
    """
    order = np.argsort(classes, kind="stable")
    sizes = np.bincount(classes, minlength=_ALPHABET)
    cls = np.flatnonzero(sizes)
    counts = sizes[cls]
    ends = np.cumsum(counts)
    starts = ends - counts
    r_sorted = ranks[order]
    gaps = np.diff(r_sorted, prepend=-1) - 1
    gaps[starts] = r_sorted[starts]
    ks = _rice_ks(r_sorted[ends - 1], counts)
    k_sym = np.repeat(ks, counts).astype(np.int64)
    q, r = gaps >> k_sym, gaps & ((1 << k_sym) - 1)
    z = z[order]
    esc = z >= _ALPHABET - 1
    kept = np.add.reduceat(~esc, starts)
    steps = np.add.reduceat(np.where(esc, 0, (z.astype(np.int64) + 1) // 2 - 1), starts)
    t_q = _ratio(np.add.reduceat(np.minimum(q, _ALPHABET - 1), starts) / counts)
    t_v = _ratio(steps / np.maximum(kept, 1))
    e = np.clip(np.ceil(256 * np.add.reduceat(esc, starts) / counts), 0, 255).astype(np.uint8)
    first, span = int(cls[0]), int(cls[-1] - cls[0]) + 1
    present = np.zeros(span, np.uint8)
    present[cls - first] = 1
    head = bytearray(struct.pack("<BB", first, span - 1))
    head += np.packbits(present, bitorder="little").tobytes() + ks.tobytes() + t_q.tobytes() + t_v.tobytes()
    head += e.tobytes()
    for c in counts.tolist():
        write_varint(head, c)
    qsym, zsym = np.minimum(q, _ALPHABET - 1).astype(np.int32), np.minimum(z, _ALPHABET - 1).astype(np.int32)
    qesc, zesc = q[q >= _ALPHABET - 1], z[esc]
    pos = b"".join(
        [
            bytes(head),
            struct.pack("<I", len(qesc)),
            qesc.astype("<u4").tobytes(),
            kernels.pack_bits(r, k_sym).tobytes(),
            _encode_runs(qsym, counts, [_gap_weights(t) for t in t_q.tolist()]),
        ]
    )
    val = b"".join(
        [
            struct.pack("<I", len(zesc)),
            zesc.astype(z.dtype.newbyteorder("<")).tobytes(),
            _encode_runs(zsym, counts, [_value_weights(t, x) for t, x in zip(t_v.tolist(), e.tolist())]),
        ]
    )
    return pos, val


def context_decode(
    pos_buf: memoryview, val_buf: memoryview, dtype: np.dtype, count: int, length: int, what: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of context_streams, up to the base: the classes present, their counts, the gaps
    (in class order: how many of the class's elements to pass before each change) and the
    differences in class order. Every field is checked; a gap past its class's elements is
    caught where the base is walked (kernels.class_locate)."""
    cur = Cursor(pos_buf, what)
    first, span = cur.unpack("<BB")
    span += 1
    if first + span > _ALPHABET:
        raise CorruptError(f"{what}: classes {first} to {first + span - 1} beyond {_ALPHABET - 1}")
    present = np.unpackbits(cur.array(np.uint8, (span + 7) // 8), bitorder="little")
    if present[span:].any() or not present[0] or not present[span - 1]:
        raise CorruptError(f"{what}: class bitmap does not match its span")
    cls = (first + np.flatnonzero(present)).astype(np.uint8)
    n = len(cls)
    ks, t_q, t_v, e = (cur.array(np.uint8, n) for _ in range(4))
    if ks.max() > _MAX_K:
        raise CorruptError(f"{what}: Rice parameter {int(ks.max())} out of range")
    counts = np.array([_read_count(cur) for _ in range(n)], np.int64)
    if int(counts.sum()) != count:
        raise CorruptError(f"{what}: classes hold {int(counts.sum())} changes, the record {count}")
    k_sym = np.repeat(ks, counts).astype(np.int64)
    (n_qesc,) = cur.unpack("<I")
    if n_qesc > count:
        raise CorruptError(f"{what}: {n_qesc} gap escapes for {count} changes")
    qesc = cur.array("<u4", n_qesc).astype(np.int64)
    r = kernels.unpack_bits(np.frombuffer(cur.take((int(k_sym.sum()) + 7) // 8), np.uint8), k_sym)
    q = _decode_runs(cur.take(len(cur.buf) - cur.pos), counts, [_gap_weights(t) for t in t_q.tolist()], what)
    q = _substitute(q, qesc, f"{what}: gaps")
    gaps = (q << k_sym) | r  # q < 2**32 and k <= 20: no overflow
    if int(gaps.max()) >= length:
        raise CorruptError(f"{what}: gap {int(gaps.max())} beyond segment length {length}")
    le = np.dtype(dtype).newbyteorder("<").str
    vcur = Cursor(val_buf, f"{what}, values")
    (n_vesc,) = vcur.unpack("<I")
    if n_vesc > count:
        raise CorruptError(f"{what}: {n_vesc} value escapes for {count} changes")
    vesc = vcur.array(le, n_vesc)
    z = _decode_runs(
        vcur.take(len(vcur.buf) - vcur.pos),
        counts,
        [_value_weights(t, x) for t, x in zip(t_v.tolist(), e.tolist())],
        vcur.what,
    )
    return cls, counts, gaps, _substitute(z, vesc, vcur.what).astype(le)


def _substitute(sym: np.ndarray, esc: np.ndarray, what: str) -> np.ndarray:
    """Escape symbols (255) replaced, in order, by the escaped values, which must all be >= 255."""
    is_esc = sym == _ALPHABET - 1
    if int(is_esc.sum()) != len(esc):
        raise CorruptError(f"{what}: {int(is_esc.sum())} escape symbols but {len(esc)} escaped values")
    if len(esc) and (esc < _ALPHABET - 1).any():
        raise CorruptError(f"{what}: escaped value below the escape threshold")
    out = sym.copy()
    out[is_esc] = esc
    return out
