"""CPU kernels (numba, GIL-free): one fused pass where numpy needs several.

numpy's `flatnonzero(a != b)` plus two gathers costs three passes and random DRAM reads; the
fused kernel compares 64-bit words, looks inside the few that differ, and takes the old and new
bit patterns while they are in cache (measured ~1.6x faster cold, and it runs on every core).
The hash kernels compute the splitmix64 sums of `statehash` without temporaries.

Each kernel compiles once (seconds) and is cached on disk where the process may write: numba's
default, a `__pycache__` beside this file, in a checkout or a user's own install. In the runtime
image that folder is root's and uid 65532 has no home (`HOME=/`), where numba's `cache=True`
fails at import; there the cache goes to a folder of the user's own in the temporary folder
(`TMPDIR`, `/tmp`), and with none writable each process compiles the kernels itself. A
`NUMBA_CACHE_DIR` that is set wins.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from sparrowrl.cachedir import own, writable


def _cache() -> bool:
    """Whether the kernels are cached on disk; sets NUMBA_CACHE_DIR where numba's default cannot
    be written (sparrowrl.cachedir)."""
    if os.environ.get("NUMBA_CACHE_DIR") or writable(Path(__file__).parent / "__pycache__"):
        return True
    d = own("numba")
    if d is not None:
        os.environ["NUMBA_CACHE_DIR"] = str(d)
    return d is not None


_CACHE = _cache()

from numba import njit  # noqa: E402  (after NUMBA_CACHE_DIR)
from numba.core.config import reload_config  # noqa: E402

# numba reads its environment once, at import: this process may have imported it before. numba leaves
# reload_config unannotated.
reload_config()  # type: ignore[no-untyped-call]

_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def _changed(
    a: np.ndarray,
    b: np.ndarray,
    aw: np.ndarray,
    bw: np.ndarray,
    shift: int,
    mask: int,
    idx: np.ndarray,
    va: np.ndarray,
    vb: np.ndarray,
    cls: np.ndarray,
    rank: np.ndarray,
) -> int:
    """Fill idx/va/vb with the changes, cls/rank with each one's class in `a` and its rank
    among the elements of that class before it; -1 if they do not fit (the caller retries
    larger). Classes are counted in one lane per element of a 64-bit word, so that neighbours
    of one class do not wait on each other's count; without a class field (mask 0) the rank is
    the position."""
    k = 0
    cap = idx.shape[0]
    per = 8 // a.itemsize
    cnt = np.zeros((per, 256), np.int64)
    s, mk = np.uint64(shift), np.uint64(mask)
    for w in range(aw.shape[0]):
        base = w * per
        if aw[w] != bw[w]:
            for j in range(per):
                x = a[base + j]
                c = (np.uint64(x) >> s) & mk
                if x != b[base + j]:
                    if k == cap:
                        return -1
                    idx[k] = base + j
                    va[k] = x
                    vb[k] = b[base + j]
                    cls[k] = c
                    t = base + j
                    if mask:
                        t = 0
                        for lane in range(per):
                            t += cnt[lane, c]
                    rank[k] = t
                    k += 1
                if mask:
                    cnt[j, c] += 1
        elif mask:
            for j in range(per):
                cnt[j, (np.uint64(a[base + j]) >> s) & mk] += 1
    for i in range(aw.shape[0] * per, a.shape[0]):
        c = (np.uint64(a[i]) >> s) & mk
        if a[i] != b[i]:
            if k == cap:
                return -1
            idx[k] = i
            va[k] = a[i]
            vb[k] = b[i]
            cls[k] = c
            t = i
            if mask:
                t = 0
                for lane in range(per):
                    t += cnt[lane, c]
            rank[k] = t
            k += 1
        cnt[0, c] += 1
    return k


def changed(
    a: np.ndarray, b: np.ndarray, fld: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old patterns, new patterns, classes, ranks) where two flat unsigned arrays
    differ; a change's class is the field `(old >> shift) & mask` (`context`), its rank its
    place among the elements of its class, counted in the same pass.

    Output buffers are sized for sparse steps (1/16 of the segment) and redone at full size
    only when more changed, to avoid large allocations on the common path."""
    n = a.shape[0]
    per = 8 // a.dtype.itemsize
    m = n - n % per
    aw = np.ascontiguousarray(a[:m]).view(np.uint64)
    bw = np.ascontiguousarray(b[:m]).view(np.uint64)
    for cap in (n // 16 + 64, n):
        idx, rank = np.empty(cap, np.int64), np.empty(cap, np.int64)
        va, vb, cls = np.empty(cap, a.dtype), np.empty(cap, b.dtype), np.empty(cap, np.uint8)
        k = _changed(a, b, aw, bw, fld[0], fld[1], idx, va, vb, cls, rank)
        if k >= 0:
            return idx[:k].copy(), va[:k].copy(), vb[:k].copy(), cls[:k].copy(), rank[:k].copy()
    raise AssertionError("unreachable: a full-size buffer always fits")


@njit(inline="always")
def _mix(x: np.uint64) -> np.uint64:
    x ^= x >> np.uint64(30)
    x *= _C1
    x ^= x >> np.uint64(27)
    x *= _C2
    x ^= x >> np.uint64(31)
    return x


@njit(inline="always")
def _h(salt: np.uint64, width: np.uint64, compact: bool, i: np.uint64, v: np.uint64) -> np.uint64:
    if compact:
        return _mix(salt + (i << width) + v)
    return _mix(_mix(salt + i) ^ v)


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def hash_range(salt: np.uint64, width: int, compact: bool, start: int, vals: np.ndarray) -> np.uint64:
    """Sum of h(start + j, vals[j]) over j, mod 2**64."""
    acc = np.uint64(0)
    w = np.uint64(width)
    s = np.uint64(start)
    for j in range(vals.shape[0]):
        acc += _h(salt, w, compact, s + np.uint64(j), np.uint64(vals[j]))
    return acc


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def hash_change(
    salt: np.uint64, width: int, compact: bool, idx: np.ndarray, old: np.ndarray, new: np.ndarray
) -> np.uint64:
    """Sum of h(i, new) - h(i, old) over the changed positions, mod 2**64."""
    acc = np.uint64(0)
    w = np.uint64(width)
    for j in range(idx.shape[0]):
        i = np.uint64(idx[j])
        acc += _h(salt, w, compact, i, np.uint64(new[j]))
        acc -= _h(salt, w, compact, i, np.uint64(old[j]))
    return acc


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def symbols(idx: np.ndarray, old: np.ndarray, new: np.ndarray, k: int, width: int) -> tuple[np.ndarray, ...]:
    """One pass from changes to the entropy coder's inputs.

    Gaps g (idx[0], then idx[j] - idx[j-1] - 1) split as q = g >> k (symbol, escaped at 255) and
    r = g & (2**k - 1); value symbols are the zigzagged wrap-around differences new - old,
    escaped at 255. Returns q, r, q counts, q escapes, value symbols, value counts, value escapes.
    """
    n = idx.shape[0]
    q = np.empty(n, np.int32)
    r = np.empty(n, np.int32)
    qc = np.zeros(256, np.int64)
    qesc = np.empty(n, np.uint32)
    v = np.empty(n, np.int32)
    vc = np.zeros(256, np.int64)
    vesc = np.empty_like(new)
    nq = 0
    nv = 0
    rmask = (1 << k) - 1
    w = np.uint64(width)
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - width)
    prev = -1
    for j in range(n):
        g = idx[j] - prev - 1
        prev = idx[j]
        qq = g >> k
        r[j] = g & rmask
        if qq >= 255:
            q[j] = 255
            qesc[nq] = qq
            nq += 1
            qc[255] += 1
        else:
            q[j] = qq
            qc[qq] += 1
        d = (np.uint64(new[j]) - np.uint64(old[j])) & mask
        sign = d >> (w - np.uint64(1))
        z = ((d << np.uint64(1)) ^ (np.uint64(0) - sign)) & mask
        if z >= 255:
            v[j] = 255
            vesc[nv] = z
            nv += 1
            vc[255] += 1
        else:
            v[j] = z
            vc[z] += 1
    return q, r, qc, qesc[:nq], v, vc, vesc[:nv]


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def ans_cdf(counts: np.ndarray) -> np.ndarray:
    """The fixed-point CDF (24-bit) that constriction's `Categorical(counts, perfect=False)`
    quantizes `counts` to: cdf[i] = trunc(sum(counts[:i]) * (2**24 - n) / sum(counts)) + i, so
    that every symbol gets at least 1. Counts are integers, so every float sum here is exact."""
    n = counts.shape[0]
    total = 0.0
    for i in range(n):
        total += np.float64(counts[i])
    scale = np.float64((1 << 24) - n) / total
    cdf = np.empty(n + 1, np.uint32)
    cum = 0.0
    for i in range(n):
        cdf[i] = np.uint32(np.uint64(cum * scale) + np.uint64(i))
        cum += np.float64(counts[i])
    cdf[n] = np.uint32(1 << 24)
    return cdf


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def ans_encode(sym: np.ndarray, cdfs: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The u32 words of constriction's AnsCoder (u64 state, 24-bit precision) after
    `encode_reverse` of each run of symbols over its cdf, last run first, bit for bit as the
    library writes them (tests/test_fuzz.py), without the GIL: `ans_decode` pops run 0 first.
    Every symbol must have a nonzero width in its cdf (`ans_cdf` gives each at least 1)."""
    out = np.empty(sym.shape[0] + 2, np.uint32)  # a symbol pushes at most one word
    top = 0
    state = np.uint64(0)
    end = sym.shape[0]
    for run in range(counts.shape[0] - 1, -1, -1):
        cdf = cdfs[run]
        for j in range(end - 1, end - counts[run] - 1, -1):
            lo = np.uint64(cdf[sym[j]])
            width = np.uint64(cdf[sym[j] + 1]) - lo
            if (state >> np.uint64(40)) >= width:
                out[top] = np.uint32(state & np.uint64(0xFFFFFFFF))
                top += 1
                state >>= np.uint64(32)
            state = ((state // width) << np.uint64(24)) | (state % width + lo)
        end -= counts[run]
    if state != 0:  # sealed: the state's words, its high word last and never zero
        out[top] = np.uint32(state & np.uint64(0xFFFFFFFF))
        top += 1
        if state >> np.uint64(32):
            out[top] = np.uint32(state >> np.uint64(32))
            top += 1
    return out[:top]


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def ans_decode(words: np.ndarray, cdfs: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, int]:
    """Symbols popped from constriction's AnsCoder (u32 words, u64 state, 24-bit precision), bit
    for bit as constriction decodes them, without the GIL: counts[j] symbols over cdfs[j], run
    after run. Returns (symbols, status): 0 when the stack ends exactly empty, 1 when it does
    not, 2 when its top word is zero (constriction refuses those)."""
    total = 0
    for j in range(counts.shape[0]):
        total += counts[j]
    out = np.empty(total, np.int64)
    top = words.shape[0]
    state = np.uint64(0)
    if top:
        top -= 1
        if words[top] == 0:
            return out, 2
        state = np.uint64(words[top])
        while top and state < (np.uint64(1) << np.uint64(32)):
            top -= 1
            state = (state << np.uint64(32)) | np.uint64(words[top])
    n = cdfs.shape[1] - 1
    lut = np.empty(1 << 12, np.int64)  # the last symbol whose cdf is <= t << 12: a start near the answer
    mask = np.uint64((1 << 24) - 1)
    at = 0
    for run in range(counts.shape[0]):
        cdf = cdfs[run]
        s = 0
        for t in range(1 << 12):
            while s + 1 < n and cdf[s + 1] <= np.uint32(t << 12):
                s += 1
            lut[t] = s
        for j in range(at, at + counts[run]):
            q = np.uint32(state & mask)
            lo = lut[q >> np.uint32(12)]
            while cdf[lo + 1] <= q:  # cdf[n] == 2**24 > q ends it
                lo += 1
            out[j] = lo
            state = (state >> np.uint64(24)) * np.uint64(cdf[lo + 1] - cdf[lo]) + np.uint64(q - cdf[lo])
            if state < (np.uint64(1) << np.uint64(32)) and top:
                top -= 1
                state = (state << np.uint64(32)) | np.uint64(words[top])
        at += counts[run]
    return out, 0 if state == 0 else 1


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def gather(flat: np.ndarray, offset: int, positions: np.ndarray) -> np.ndarray | None:
    """flat[offset + positions] in one pass, without a temporary index array; None if any index
    falls outside `flat` (the caller's checks make that a bug, never a write out of bounds)."""
    out = np.empty(positions.shape[0], flat.dtype)
    n = flat.shape[0]
    for j in range(positions.shape[0]):
        i = offset + positions[j]
        if i < 0 or i >= n:
            return None
        out[j] = flat[i]
    return out


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def scatter(flat: np.ndarray, offset: int, positions: np.ndarray, values: np.ndarray) -> bool:
    """flat[offset + positions] = values; False, with nothing written, if any index falls outside."""
    n = flat.shape[0]
    for j in range(positions.shape[0]):
        i = offset + positions[j]
        if i < 0 or i >= n:
            return False
    for j in range(positions.shape[0]):
        flat[offset + positions[j]] = values[j]
    return True


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def class_locate(
    base: np.ndarray, shift: int, mask: int, classes: np.ndarray, counts: np.ndarray, gaps: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """Where a context record's changes are, in the base. `gaps` are grouped by class (`classes` strictly increasing,
    `counts[j]` each): how many of the class's elements to pass before each change. Returns the
    positions, sorted; for each, the index of its gap in `gaps` (values coded in class order are
    put in position order with it); and whether every change was found (False: a gap runs past
    its class's elements in this base)."""
    skip = np.full(256, np.int64(1) << np.int64(62), np.int64)  # classes without changes never reach 0
    ptr = np.zeros(256, np.int64)
    end = np.zeros(256, np.int64)
    at = 0
    for j in range(classes.shape[0]):
        c = classes[j]
        ptr[c] = at
        skip[c] = gaps[at]
        at += counts[j]
        end[c] = at
    pos = np.empty(at, np.int64)
    src = np.empty(at, np.int64)
    s, mk = np.uint64(shift), np.uint64(mask)
    k = 0
    for i in range(base.shape[0]):
        c = (np.uint64(base[i]) >> s) & mk
        r = skip[c]
        if r == 0:
            pos[k] = i
            p = ptr[c]
            src[k] = p
            k += 1
            p += 1
            ptr[c] = p
            skip[c] = gaps[p] if p < end[c] else np.int64(1) << np.int64(62)
        else:
            skip[c] = r - 1
    return pos[:k], src[:k], k == at


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def pack_bits(vals: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """The low ks[j] bits of each vals[j], concatenated LSB-first into ceil(sum(ks) / 8) bytes."""
    total = 0
    for j in range(ks.shape[0]):
        total += ks[j]
    out = np.zeros((total + 7) // 8, np.uint8)
    acc = np.uint64(0)
    nbits = 0
    pos = 0
    for j in range(vals.shape[0]):
        acc |= np.uint64(vals[j]) << np.uint64(nbits)
        nbits += ks[j]
        while nbits >= 8:
            out[pos] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nbits -= 8
            pos += 1
    if nbits > 0:
        out[pos] = np.uint8(acc & np.uint64(0xFF))
    return out


@njit(nogil=True, cache=_CACHE, boundscheck=False)
def unpack_bits(buf: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """Inverse of pack_bits; the caller checks len(buf) == ceil(sum(ks) / 8)."""
    n = ks.shape[0]
    out = np.empty(n, np.int64)
    acc = np.uint64(0)
    nbits = 0
    pos = 0
    for j in range(n):
        k = ks[j]
        while nbits < k:
            acc |= np.uint64(buf[pos]) << np.uint64(nbits)
            nbits += 8
            pos += 1
        out[j] = np.int64(acc & ((np.uint64(1) << np.uint64(k)) - np.uint64(1)))
        acc >>= np.uint64(k)
        nbits -= k
    return out
