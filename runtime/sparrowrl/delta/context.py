"""What both ends of a delta hold before it travels: the base. Since format 2 a delta codes each
change in its context, the class of the base element it changes.

An update changes a bf16 element when it exceeds half a ULP of the element's value, and Adam's
updates are about the same size everywhere, so whether an element changes depends mostly on its
exponent: small elements change far more often than large ones. The class of an element is that
exponent field of its base bit pattern (`FIELDS`; one class for dtypes without one). A change is
coded as its class and its rank among the segment's elements of that class; each class's own
model codes the gaps between its ranks (`entropy.context_streams`).

On the host, the extraction kernel (`kernels.changed`) classifies and ranks in the pass that
finds the changes, and `kernels.class_locate` finds them again in one pass over the base. For
tensors on an accelerator, `ranks_on_device` and `locate_on_device` do the same with a stable
sort of the classes where the tensor lives, so only changed elements cross to the host; they
give the same arrays (tests run them on CPU tensors).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# dtype -> (shift, mask) of its exponent field in the bit pattern
FIELDS: dict[str, tuple[int, int]] = {
    "BF16": (7, 0xFF),
    "F16": (10, 0x1F),
    "F32": (23, 0xFF),
    "F8_E4M3": (3, 0xF),
    "F8_E5M2": (2, 0x1F),
}


def field(dtype: str) -> tuple[int, int]:
    """(shift, mask) of a dtype's class field; (0, 0), one class, for dtypes without exponent."""
    return FIELDS.get(dtype, (0, 0))


_ONE_AT_A_TIME = threading.Lock()  # the pool's threads would each hold a segment's sort in device memory


def _sorted_classes(base: torch.Tensor, fld: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each element's class (in the base's own integer dtype: every field sits below the sign
    bit), the elements in class order (stable), and how many each class holds."""
    shift, mask = fld
    c = (base >> shift) & mask if mask else torch.zeros_like(base)
    order = torch.sort(c, stable=True).indices
    return c, order, torch.bincount(c.to(torch.int32), minlength=256)


def ranks_on_device(base: torch.Tensor, fld: tuple[int, int], positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The classes and ranks that kernels.changed gives, for a segment of a tensor on an
    accelerator (`base`: its flat integer bit view there), as host arrays."""
    if not len(positions):
        return np.empty(0, np.uint8), np.empty(0, np.int64)
    with _ONE_AT_A_TIME:
        c, order, sizes = _sorted_classes(base, fld)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0], device=order.device)
        at = torch.from_numpy(positions).to(base.device)
        cls = c[at].to(torch.int64)
        return cls.to(torch.uint8).cpu().numpy(), (inverse[at] - (torch.cumsum(sizes, 0) - sizes)[cls]).cpu().numpy()


def locate_on_device(
    base: torch.Tensor, fld: tuple[int, int], classes: np.ndarray, counts: np.ndarray, gaps: np.ndarray
) -> tuple[np.ndarray, np.ndarray, bool]:
    """kernels.class_locate for a segment of a tensor on an accelerator: the same three results."""
    run = np.cumsum(gaps + 1)
    ends = np.cumsum(counts)
    ranks = run - np.repeat(np.concatenate([[0], run[ends - 1][:-1]]), counts) - 1
    with _ONE_AT_A_TIME:
        _, order, on_device = _sorted_classes(base, fld)
        sizes = on_device.cpu().numpy()
        last = ends - 1  # ranks increase within a class: its last is its largest
        if (ranks[last] >= sizes[classes]).any():
            return np.empty(0, np.int64), np.empty(0, np.int64), False
        starts = np.cumsum(sizes) - sizes
        at = np.repeat(starts[classes], counts) + ranks
        pos, src = torch.sort(order[torch.from_numpy(at).to(base.device)])
        return pos.cpu().numpy(), src.cpu().numpy(), True
