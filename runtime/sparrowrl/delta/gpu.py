"""GPU path (CuPy): diff a whole CUDA tensor at once, then hand per-segment Changes to the host.

The comparison and compaction run on the device over the full tensor (one kernel pass, not one
per segment); only positions and the changed bit patterns (~1% of the model) cross to the host,
where they are split at the same segment boundaries as the CPU path and entropy-coded by the same
code, so the delta bytes are identical. Verified on a GPU by hack/gpu-check.sh only.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from sparrowrl.cachedir import under_home

under_home("CUPY_CACHE_DIR", "cupy", Path.home() / ".cupy" / "kernel_cache")  # CuPy's kernels, before it loads

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparrowrl.delta.bitview import TORCH_SINT, UINT  # noqa: E402
from sparrowrl.delta.context import ranks_on_device  # noqa: E402
from sparrowrl.delta.extract import changed_positions, zigzag  # noqa: E402
from sparrowrl.delta.records import Changes  # noqa: E402
from sparrowrl.delta.statehash import TensorKey  # noqa: E402


def device_bits(t: torch.Tensor) -> cupy.ndarray:
    """Flat unsigned bit-pattern view of a contiguous CUDA tensor, sharing its memory."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    return cupy.from_dlpack(flat.view(TORCH_SINT[size])).view(UINT[size])


def extract_tensor(
    old: torch.Tensor, new: torch.Tensor, segment: int, fld: tuple[int, int], start: int = 0
) -> list[Changes]:
    """Changes per segment of `old` and `new`, which hold a tensor's flat elements from `start` on;
    each change's class and rank in the base (`context`) are found on the device too."""
    dev = new.device.index
    with cupy.cuda.Device(dev):
        a, b = device_bits(old), device_bits(new)
        idx = changed_positions(cupy, a, b)
        host_idx = cupy.asnumpy(idx)
        host_old, host_new = cupy.asnumpy(a[idx]), cupy.asnumpy(b[idx])

    def dense(s: int, e: int) -> np.ndarray:  # runs on a pool thread: select the device again
        with cupy.cuda.Device(dev):
            d: np.ndarray = cupy.asnumpy(zigzag(cupy, a[s:e], b[s:e]))
            return d

    n = a.shape[0]
    starts = np.arange(0, n, segment, dtype=np.int64)
    cuts = np.searchsorted(host_idx, np.append(starts, n))
    flat = old.detach().contiguous().reshape(-1)
    flat = flat.view(TORCH_SINT[flat.element_size()]) if flat.dtype != torch.bool else flat.view(torch.int8)
    out = []
    for j, s in enumerate(starts.tolist()):
        lo, hi = cuts[j], cuts[j + 1]
        e = min(s + segment, n)
        positions = host_idx[lo:hi] - s
        cls, rank = ranks_on_device(flat[s:e], fld, positions)
        out.append(
            Changes(start + s, e - s, positions, host_old[lo:hi], host_new[lo:hi], cls, rank, partial(dense, s, e))
        )
    return out


_MIX = r"""
__device__ unsigned long long sparrow_mix(unsigned long long x) {
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27; x *= 0x94D049BB133111EBULL;
    x ^= x >> 31; return x;
}
"""
_ELEMENT_HASH = cupy.ElementwiseKernel(
    "T v, uint64 salt, uint64 base, int32 width, int32 compact",
    "uint64 h",
    """
    unsigned long long k = base + (unsigned long long)i;
    unsigned long long x = compact ? salt + (k << width) + (unsigned long long)v
                                   : sparrow_mix(salt + k) ^ (unsigned long long)v;
    h = sparrow_mix(x);
    """,
    "sparrow_element_hash",
    preamble=_MIX,
)


def span_hash(key: TensorKey, start: int, flat: cupy.ndarray, block: int = 1 << 26) -> int:
    """statehash.span_hash on the device, in blocks (the per-element hashes take 8 bytes each
    before the sum)."""
    total = 0
    with cupy.cuda.Device(flat.device.id):
        for s in range(0, flat.shape[0], block):
            h = _ELEMENT_HASH(
                flat[s : s + block],
                np.uint64(key.salt),
                np.uint64(start + s),
                np.int32(key.width),
                np.int32(key.compact),
            )
            total += int(h.sum(dtype=cupy.uint64))
    return total % (1 << 64)


def tensor_hash(key: TensorKey, flat: cupy.ndarray) -> int:
    """The same per-tensor contribution as statehash.tensor_hash, computed on the device."""
    return (key.term + span_hash(key, 0, flat)) % (1 << 64)
