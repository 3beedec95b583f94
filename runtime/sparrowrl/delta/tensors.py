"""One tensor of a delta's table: its name, dtype and shape, as the header lists it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrowrl.delta.bitview import dtype_name, itemsize
from sparrowrl.delta.statehash import TensorKey


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def key(self) -> TensorKey:
        return TensorKey(self.name, self.dtype, self.shape, itemsize(self.dtype))

    @staticmethod
    def of(name: str, t: torch.Tensor) -> TensorSpec:
        return TensorSpec(name, dtype_name(t.dtype), tuple(t.shape))
