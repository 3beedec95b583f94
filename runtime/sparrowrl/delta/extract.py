"""Changed elements by their bit patterns, never by float subtraction, and the zigzag-mapped
difference that the records code. On the CPU, `kernels.py` finds the changes in one fused pass;
these array-module functions serve the GPU path (CuPy) and the codec's zigzag on either, and
give the same arrays on numpy and CuPy, hence byte-identical deltas once entropy-coded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparrowrl.delta.bitview import SINT, UINT


def changed_positions(xp: Any, old: Any, new: Any) -> Any:
    """Sorted int64 positions where the bit patterns of two equal-length flat arrays differ."""
    return xp.flatnonzero(old != new)


def zigzag(xp: Any, old: Any, new: Any) -> Any:
    """Wrap-around difference new - old of unsigned bit patterns, zigzag-mapped so that small
    steps in either direction become small unsigned numbers (+1 -> 2, -1 -> 1)."""
    size = old.dtype.itemsize
    d = (new - old).view(SINT[size])
    shift = xp.asarray(8 * size - 1, dtype=d.dtype)
    return ((d << 1) ^ (d >> shift)).view(UINT[size])


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `zigzag` on the difference: returns the unsigned wrap-around difference."""
    one = z.dtype.type(1)
    d: np.ndarray = (z >> one) ^ (z.dtype.type(0) - (z & one))
    return d
