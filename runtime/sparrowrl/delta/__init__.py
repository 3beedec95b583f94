"""The sparse delta checkpoint codec.

Reading order for one delta: `records` finds the changed bit patterns of a tensor (with
`kernels`' fused pass on the CPU, `gpu` on CUDA) and entropy-codes them (via `entropy`, with
`extract`'s zigzag difference), `frame` writes/reads the chunked file, `apply` verifies and
commits it, `statehash` is the additive hash that ties base and target together.
"""

from sparrowrl.delta.apply import Slot, apply_delta
from sparrowrl.delta.errors import DeltaError
from sparrowrl.delta.frame import DeltaFile, DeltaWriter, write_delta
from sparrowrl.delta.statehash import state_hash

__all__ = ["DeltaError", "DeltaFile", "DeltaWriter", "write_delta", "Slot", "apply_delta", "state_hash"]
