"""The additive state hash: verification whose cost grows with the changed elements, not the model.

    H(state) = sum over tensors t of [ mix(salt_t) + sum over elements i of h_t(i, v_i) ]  (mod 2**64)

`v_i` is the element's bit pattern, `salt_t` comes from sha256 of the tensor's name, dtype and shape,
and `h_t(i, v) = mix(salt_t + (i << w) + v)` with `w` the item size in bits (an injective key),
or `mix(mix(salt_t + i) ^ v)` where that key would not fit in 64 bits. `mix` is the splitmix64
finaliser, a bijection. Changing element i from a to b moves H by h_t(i, b) - h_t(i, a), so a
receiver updates H from the changed elements alone; the full sum is recomputed at base snapshots.
Integrity against corruption and bugs, not against an adversary: a sum that a forger chooses the
terms of can be matched. Authenticity comes from the trainer's signatures (signing.py) over every
piece of a delta and every base, checked before a byte is staged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from sparrowrl.delta import kernels
from sparrowrl.delta.bitview import dtype_name

_BLOCK = 1 << 22


def _mix_int(v: int) -> int:
    v ^= v >> 30
    v = (v * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    v ^= v >> 27
    v = (v * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return v ^ (v >> 31)


class TensorKey:
    """What the hash needs to know about one tensor: its salt and how element keys are built."""

    def __init__(self, name: str, dtype: str, shape: Iterable[int], itemsize: int):
        shape = tuple(int(s) for s in shape)
        digest = hashlib.sha256(f"{name}\0{dtype}\0{list(shape)}".encode()).digest()
        self.salt = int.from_bytes(digest[:8], "little")
        self.numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        self.width = 8 * itemsize
        self.compact = self.width < 64 and (max(self.numel - 1, 0) >> (64 - self.width)) == 0
        self.term = _mix_int(self.salt)

    def range_sum(self, start: int, vals: np.ndarray) -> int:
        """Sum (mod 2**64) of h(start + j, vals[j])."""
        return int(kernels.hash_range(np.uint64(self.salt), self.width, self.compact, start, vals))

    def change(self, idx: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
        """H(after) - H(before) (mod 2**64) when the elements at idx go from old to new."""
        return int(kernels.hash_change(np.uint64(self.salt), self.width, self.compact, idx, old, new))


def tensor_key(name: str, t: torch.Tensor) -> TensorKey:
    return TensorKey(name, dtype_name(t.dtype), t.shape, t.element_size())


def span_hash(key: TensorKey, start: int, flat_bits: np.ndarray, pool: ThreadPoolExecutor | None = None) -> int:
    """The element terms of elements start.. of a tensor (a sharded trainer's rank holds some),
    without the tensor's own term: partial sums add up to its contribution. Blocked to stay in cache."""
    n = flat_bits.shape[0]

    def block(s: int) -> int:
        return key.range_sum(start + s, flat_bits[s : s + _BLOCK])

    parts = pool.map(block, range(0, n, _BLOCK)) if pool is not None else map(block, range(0, n, _BLOCK))
    return sum(parts) % (1 << 64)


def tensor_hash(key: TensorKey, flat_bits: np.ndarray, pool: ThreadPoolExecutor | None = None) -> int:
    """Full per-tensor contribution (including its term)."""
    return (key.term + span_hash(key, 0, flat_bits, pool)) % (1 << 64)


def format_hash(h: int) -> str:
    return f"{h % (1 << 64):016x}"


def parse_hash(s: str) -> int:
    return int(s, 16)
