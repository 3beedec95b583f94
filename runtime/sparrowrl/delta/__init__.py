"""The sparse delta checkpoint codec.

Reading guide: one delta from `optimizer.step()` to a worker's committed weights, in twelve
files (docs/architecture.md says what each does on the way):

     1 trainer/trainer.py      the training loop: a complete batch → train → checkpoint → publish
     2 trainer/learner.py      the GRPO step, then the bf16 policy's tensors into the store's writer
     3 store/store.py          the version's file, served while written, sealed by content hash
     4 delta/frame.py          header, checksummed chunks, manifest with the target hash
     5 delta/encoder.py        tensors diffed segment by segment on a thread pool
     6 delta/records.py        one segment's changed bit patterns, entropy-coded in context
     7 transport/server.py     versions listed as they appear, pieces served as written
     8 transport/client.py     a worker's verified, parallel fetch from its relay or the trainer
     9 worker/worker.py        staged during generation, committed between leases, hashed
    10 delta/apply.py          every check before any weight changes, then assignment
    11 trainer/control.py      the commit route
    12 rollout/coordinator.py  the worker's hash against the trainer's: verified or a mismatch

Within this package: `device` picks where a tensor's changed bit patterns are found, by where it
lives: `gpu` for a CUDA tensor, else `records`' CPU extraction (`kernels`' fused pass). `records`
entropy-codes them (via `entropy`, with `extract`'s zigzag difference), `encoder` runs that on a
thread pool, `frame` writes/reads the chunked file, `apply` verifies and commits it, `statehash`
is the additive hash that ties base and target together (`device` again computes it in place).
"""

from sparrowrl.delta.apply import Slot, apply_delta
from sparrowrl.delta.device import state_hash
from sparrowrl.delta.errors import DeltaError
from sparrowrl.delta.frame import DeltaFile, DeltaWriter, write_delta

__all__ = ["DeltaError", "DeltaFile", "DeltaWriter", "write_delta", "Slot", "apply_delta", "state_hash"]
