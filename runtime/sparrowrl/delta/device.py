"""Where a tensor lives picks its path, here and nowhere else: a CUDA tensor goes to `gpu` (CuPy, in
place, nothing copied to the host), any other to the CPU kernels. Both give the same hashes and the
same Changes, so callers never ask where a tensor is. `gpu` is imported on first use: CuPy is an
optional install that needs a GPU."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from sparrowrl.delta import statehash
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.records import Changes, extract_segment
from sparrowrl.delta.statehash import TensorKey, format_hash, tensor_key


def span_hash(key: TensorKey, start: int, flat: torch.Tensor, pool: ThreadPoolExecutor | None = None) -> int:
    """`statehash.span_hash` of `flat`, elements `start`.. of the tensor `key` describes."""
    if flat.is_cuda:
        from sparrowrl.delta import gpu

        return gpu.span_hash(key, start, gpu.device_bits(flat))
    return statehash.span_hash(key, start, bits(flat), pool)


def state_hash(state: Mapping[str, torch.Tensor]) -> str:
    """Full recomputation of the state hash over a {name: tensor} state, as 16 hex digits."""
    total = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for name, t in state.items():
            key = tensor_key(name, t)
            total += key.term + span_hash(key, 0, t, pool)
    return format_hash(total)


def _given(ch: Changes) -> Callable[[], Changes]:
    """Changes found already, as the call that gives them."""
    return lambda: ch


def segments(
    old: torch.Tensor, new: torch.Tensor, segment: int, fld: tuple[int, int], start: int = 0
) -> list[Callable[[], Changes]]:
    """One call per segment of `old` and `new` (a tensor's flat elements from `start` on) that gives
    its Changes, for a pool thread to run. `new` picks the path: the CPU diffs each segment in its
    call; the GPU diffs the whole range here at once (one kernel pass), and the calls hand it over."""
    if new.is_cuda:
        from sparrowrl.delta import gpu

        return [_given(ch) for ch in gpu.extract_tensor(old, new, segment, fld, start)]
    a, b = bits(old), bits(new)
    return [
        partial(extract_segment, start + s, a[s : s + segment], b[s : s + segment], fld)
        for s in range(0, a.shape[0], segment)
    ]
