"""Tensors as arrays of unsigned bit patterns: the only view in which the codec compares or assigns.

Floats are never subtracted as floats (`a - b + b` is not `a` in bf16); every dtype is handled as an
unsigned integer of its item size, so NaN payloads, -0.0 and subnormals survive bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

# safetensors dtype name -> (torch dtype, item size in bytes)
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
_NAME_OF = {t: name for name, (t, _) in DTYPES.items()}
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
TORCH_SINT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(t: torch.dtype) -> str:
    try:
        return _NAME_OF[t]
    except KeyError:
        raise TypeError(f"dtype {t} is not supported by the delta codec") from None


def itemsize(name: str) -> int:
    return DTYPES[name][1]


def bits(t: torch.Tensor) -> np.ndarray:
    """A flat unsigned-integer numpy view of a CPU tensor's storage (no copy when contiguous)."""
    size = t.element_size()
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(TORCH_SINT[size]).numpy().view(UINT[size])
