"""Entropy coding of a sparse record's two integer streams, and zstd for dense records.

Both sparse streams use ANS (constriction's stack coder) with a categorical model whose symbol
counts travel with the stream; symbols at 255 escape to a raw side array. This gets within ~1%
of the empirical entropy of i.i.d. symbols, which zstd's Huffman stage cannot (measured: zstd of
byte-shuffled gaps and differences costs ~12% more per changed element, and never won a stream
on realistic or real-training steps).
Positions use a Rice split: gap = q * 2**k + r, q categorical, r as k raw bits (packed by a
GIL-free kernel; ANS would spend the same bits, slower). For geometric gaps q and r are
independent, so the split loses nothing.
"""

from __future__ import annotations

import struct

import constriction
import numpy as np
import zstandard

from sparrowrl.delta import kernels
from sparrowrl.delta.errors import CorruptError

_ALPHABET = 256  # symbols 0..254 literal, 255 = escape
_MAX_K = 20
_ZLEVEL = 3
_Categorical = constriction.stream.model.Categorical
_AnsCoder = constriction.stream.stack.AnsCoder


class Cursor:
    """Bounds-checked reads from a record body; overruns are corruption, not IndexError."""

    def __init__(self, buf: bytes | memoryview, what: str):
        self.buf = memoryview(buf)
        self.pos = 0
        self.what = what

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CorruptError(f"{self.what}: truncated (needs {n} bytes at offset {self.pos}, has {len(self.buf) - self.pos})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def array(self, dtype: np.dtype, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(dt.itemsize * count), dtype=dt).copy()

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

def _model(counts: np.ndarray):
    return _Categorical(counts.astype(np.float64), perfect=False)


def _ans_decode(words: np.ndarray, counts: np.ndarray, count: int, what: str) -> np.ndarray:
    """Decode `count` symbols from one ANS stack, which must then be exactly empty. A numba port
    of constriction's decoder (`kernels.ans_decode`, bit-exact with it: tests/test_fuzz.py), which
    releases the GIL, so that a delta's chunks decode in parallel."""
    out, status = kernels.ans_decode(words, kernels.ans_cdf(counts), count)
    if status == 2:
        raise CorruptError(f"{what}: ANS stream does not decode (its last word is zero)")
    if status:
        raise CorruptError(f"{what}: ANS stream has undecoded bits left")
    return out


def _trim(counts: np.ndarray) -> np.ndarray:
    """The model's table: up to the last used symbol, at least 2 long (constriction's minimum).
    The decoder rebuilds exactly this array from the sparse table, so both build the same model."""
    used = np.flatnonzero(counts)
    return counts[:max(int(used[-1]) + 1 if len(used) else 0, 2)]


def _write_counts(counts: np.ndarray) -> bytes:
    """Sparse symbol table: u16 n, n symbols (u8), n LEB128 counts. Typically ~100 bytes."""
    sym = np.flatnonzero(counts)
    out = bytearray(struct.pack("<H", len(sym)))
    out += sym.astype(np.uint8).tobytes()
    for c in counts[sym].tolist():
        while c >= 0x80:
            out.append((c & 0x7F) | 0x80)
            c >>= 7
        out.append(c)
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
        c, shift = 0, 0
        while True:
            (byte,) = cur.take(1)
            c |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
            if shift > 35:
                raise CorruptError(f"{cur.what}: symbol count too long")
        if c == 0:
            raise CorruptError(f"{cur.what}: zero count in symbol table")
        counts[s] = c
    return counts


def _pack(sym: np.ndarray, counts: np.ndarray, esc: np.ndarray, esc_dtype: str, middle: bytes = b"") -> bytes:
    """table | u32 n_esc | escapes | middle | ANS words of the symbols."""
    counts = _trim(counts)
    coder = _AnsCoder()
    coder.encode_reverse(sym, _model(counts))
    return b"".join([_write_counts(counts), struct.pack("<I", len(esc)), esc.astype(esc_dtype).tobytes(), middle,
                     coder.get_compressed().astype("<u4").tobytes()])


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
    rest = cur.take(len(cur.buf) - cur.pos)
    if len(rest) % 4:
        raise CorruptError(f"{what}: ANS words not a multiple of 4 bytes")
    sym = _ans_decode(np.frombuffer(rest, "<u4").astype(np.uint32), counts, count, what)
    is_esc = sym == _ALPHABET - 1
    if int(is_esc.sum()) != n_esc:
        raise CorruptError(f"{what}: {int(is_esc.sum())} escape symbols but {n_esc} escaped values")
    if n_esc and (esc < _ALPHABET - 1).any():
        raise CorruptError(f"{what}: escaped value below the escape threshold")
    out = sym.astype(out_dtype)
    out[is_esc] = esc
    return out, middle


def ans_values(sym: np.ndarray, counts: np.ndarray, esc: np.ndarray) -> bytes:
    """Value stream: table | n_esc | escapes (item size each) | ANS words."""
    return _pack(sym, counts, esc, esc.dtype.newbyteorder("<").str)


def ans_values_decode(buf: memoryview, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    le = np.dtype(dtype).newbyteorder("<").str
    return _unpack(Cursor(buf, what), count, le, 0, le)[0]


def rice_k(last: int, count: int) -> int:
    """Rice parameter from the mean gap: 2**k about a quarter to an eighth of it, so r is near
    uniform (coding it raw loses ~0.01 bit) while q stays small (mean ~4-8, escapes rare)."""
    mean = (last + 1 - count) / count
    return int(min(_MAX_K, max(0, np.floor(np.log2(mean + 1.0)) - 2)))


def ans_gaps(k: int, q: np.ndarray, r: np.ndarray, counts: np.ndarray, esc: np.ndarray) -> bytes:
    """Position stream: u8 k | table(q) | n_esc | escapes (u32) | r (k bits each) | ANS words (q)."""
    return struct.pack("<B", k) + _pack(q, counts, esc, "<u4", kernels.pack_bits(r, k).tobytes())


def ans_gaps_decode(buf: memoryview, count: int, what: str) -> np.ndarray:
    cur = Cursor(buf, what)
    (k,) = cur.unpack("<B")
    if k > _MAX_K:
        raise CorruptError(f"{what}: Rice parameter {k} out of range")
    q, low = _unpack(cur, count, "<u4", (count * k + 7) // 8, "<i8")
    g = q << k
    if k:
        g |= kernels.unpack_bits(np.frombuffer(low, np.uint8), k, count)
    return g
