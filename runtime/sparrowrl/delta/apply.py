"""Apply a delta by assignment of bit patterns: verify everything, then change weights, or nothing.

Staging decodes every record and computes, from the changed elements alone, the state hash the
result will have. Only if framing, digests, base hash, tensor table and that target hash all
check out are the staged bit patterns assigned. A full recomputation afterwards is optional (used
at base snapshots); if it disagrees, the assignment is rolled back from the staged old values.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from sparrowrl.delta import context, kernels
from sparrowrl.delta.bitview import SINT, TORCH_SINT, UINT, bits, dtype_name, itemsize
from sparrowrl.delta.errors import MismatchError, VerifyError
from sparrowrl.delta.extract import unzigzag
from sparrowrl.delta.frame import DeltaFile
from sparrowrl.delta.records import Record
from sparrowrl.delta.statehash import format_hash, parse_hash, tensor_hash
from sparrowrl.delta.tensors import TensorSpec

_M64 = (1 << 64) - 1


@dataclass
class Slot:
    """Where one of the delta's tensors lives on the receiver: a writable flat bit-pattern view
    and the element offset of the tensor inside it. A fused layout (vLLM's qkv_proj, where q, k
    and v are stacked along dim 0) maps q, k and v to the same view at different offsets."""

    flat: np.ndarray
    offset: int = 0

    def view(self, numel: int) -> np.ndarray:
        return self.flat[self.offset : self.offset + numel]

    def gather(self, positions: np.ndarray) -> np.ndarray:
        out = kernels.gather(self.flat, self.offset, positions)
        if out is None:
            raise IndexError(f"positions beyond a slot of {self.flat.shape[0]} elements")
        return out

    def scatter(self, positions: np.ndarray, values: np.ndarray) -> None:
        if not kernels.scatter(self.flat, self.offset, positions, values):
            raise IndexError(f"positions beyond a slot of {self.flat.shape[0]} elements")

    def locate(
        self, start: int, length: int, fld: tuple[int, int], classes: np.ndarray, counts: np.ndarray, gaps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        """A context record's positions, found in this slot's base (kernels.class_locate)."""
        at = self.offset + start
        return kernels.class_locate(self.flat[at : at + length], fld[0], fld[1], classes, counts, gaps)


@dataclass
class DeviceSlot:
    """A slot in a tensor on an accelerator (flat: its signed-integer bit view, as a torch
    tensor). Only the changed elements cross to the host and back; `view` copies the whole.
    Slot's methods, each on a torch tensor: not a subclass of Slot, whose `flat` is a numpy array."""

    flat: torch.Tensor
    offset: int = 0

    def __post_init__(self) -> None:
        if self.flat.dtype not in TORCH_SINT.values() or self.flat.dim() != 1:
            raise TypeError(
                f"a device slot needs a flat signed-integer bit view, not {self.flat.dtype}{list(self.flat.shape)}"
            )

    def _host(self, t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy().view(UINT[t.element_size()])

    def view(self, numel: int) -> np.ndarray:
        return self._host(self.flat[self.offset : self.offset + numel])

    def gather(self, positions: np.ndarray) -> np.ndarray:
        return self._host(self.flat[torch.from_numpy(self.offset + positions).to(self.flat.device)])

    def scatter(self, positions: np.ndarray, values: np.ndarray) -> None:
        at = torch.from_numpy(self.offset + positions).to(self.flat.device)
        self.flat[at] = torch.from_numpy(values.view(SINT[values.itemsize])).to(self.flat.device)

    def locate(
        self, start: int, length: int, fld: tuple[int, int], classes: np.ndarray, counts: np.ndarray, gaps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, bool]:
        at = self.offset + start
        return context.locate_on_device(self.flat[at : at + length], fld, classes, counts, gaps)


SlotMap = Callable[[TensorSpec], Slot | DeviceSlot]


def state_slots(state: Mapping[str, torch.Tensor]) -> SlotMap:
    """The identity layout: each delta tensor is the state's tensor of the same name."""

    def slot(spec: TensorSpec) -> Slot | DeviceSlot:
        t = state.get(spec.name)
        if t is None:
            raise MismatchError(f"tensor '{spec.name}' is in the delta but not in the base")
        if dtype_name(t.dtype) != spec.dtype or tuple(t.shape) != spec.shape:
            raise MismatchError(
                f"tensor '{spec.name}': delta expects {spec.dtype}{list(spec.shape)}, "
                f"base has {dtype_name(t.dtype)}{list(t.shape)}"
            )
        if not t.is_contiguous():
            raise MismatchError(f"tensor '{spec.name}' must be contiguous to apply in place")
        if t.device.type != "cpu":
            return DeviceSlot(t.view(-1).view(TORCH_SINT[t.element_size()]))
        return Slot(bits(t))

    return slot


def hash_through(specs: list[TensorSpec], slot_of: SlotMap) -> str:
    """Full state hash of the receiver as the delta's tensors see it (layout-independent)."""
    total = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for spec in specs:
            slot = slot_of(spec)
            total += tensor_hash(spec.key(), slot.view(spec.numel), pool)
    return format_hash(total)


@dataclass
class _Staged:
    slot: Slot | DeviceSlot
    positions: np.ndarray  # elements that change, in the tensor
    old: np.ndarray
    new: np.ndarray


def apply_delta(
    delta: DeltaFile,
    state: Mapping[str, torch.Tensor] | None = None,
    *,
    slot_of: SlotMap | None = None,
    base_hash: str | None = None,
    verify_full: bool = False,
) -> str:
    """Apply `delta` to `state` (or to the views `slot_of` gives) in place; return the new hash.

    `base_hash` is the receiver's tracked hash; without it the base is hashed in full first.
    """
    if slot_of is None:
        if state is None:
            raise ValueError("apply_delta needs a state or a slot map")
        extra = sorted(set(state) - {t.name for t in delta.tensors})
        if extra:
            raise MismatchError(f"tensor '{extra[0]}' is in the base but not in the delta")
        slot_of = state_slots(state)
    m = delta.manifest
    slots = [slot_of(spec) for spec in delta.tensors]
    for spec, slot in zip(delta.tensors, slots):
        if slot.flat.dtype.itemsize != itemsize(spec.dtype) or slot.offset + spec.numel > slot.flat.shape[0]:
            raise MismatchError(f"tensor '{spec.name}': receiver slot does not fit {spec.dtype}{list(spec.shape)}")
    have = base_hash if base_hash is not None else hash_through(delta.tensors, slot_of)
    if have != m["base_hash"]:
        raise MismatchError(
            f"base hash mismatch: delta needs {m['base_hash']} (version {m['base_version']}), base has {have}"
        )

    n = len(delta.tensors)
    keys = [spec.key() for spec in delta.tensors]

    def stage(rec: Record) -> tuple[Record, np.ndarray, np.ndarray, _Staged | None, int]:
        """A record's changes, in a pool thread: positions in the tensor and differences, and in
        host memory also the old and new bit patterns and the hash change. A device's are read
        per tensor below, in one transfer."""
        if rec.positions is None:  # dense: a difference for every element, zero where unchanged
            pos = np.flatnonzero(rec.diffs)
            d = rec.diffs[pos]
        else:
            pos, d = rec.positions, rec.diffs
        pos = pos + rec.start
        slot = slots[rec.tensor_id]
        if isinstance(slot, DeviceSlot):
            return rec, pos, d, None, 0
        old = slot.gather(pos)
        new = old + unzigzag(d)
        return rec, pos, d, _Staged(slot, pos, old, new), keys[rec.tensor_id].change(pos, old, new)

    fields = [context.field(spec.dtype) for spec in delta.tensors]

    def locate(tid: int, start: int, length: int, *found: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        return slots[tid].locate(start, length, fields[tid], *found)

    changed, ends, hash_delta = [0] * n, [-1] * n, [0] * n
    staged: list[_Staged] = []
    on_device: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for rec, pos, d, host, h in delta.records(pool, stage, locate):  # records decode and stage in parallel
            tid = rec.tensor_id
            if rec.start < ends[tid]:
                raise VerifyError(f"tensor '{delta.tensors[tid].name}': records overlap at element {rec.start}")
            ends[tid] = rec.start + rec.length
            changed[tid] += rec.count
            if changed[tid] > m["tensors"][tid]["changed"]:
                raise VerifyError(
                    f"tensor '{delta.tensors[tid].name}': records hold more changes than the manifest's "
                    f"{m['tensors'][tid]['changed']}"
                )
            if host is None:
                on_device[tid].append((pos, d))
            else:
                staged.append(host)
                hash_delta[tid] += h
    for tid, parts in enumerate(on_device):  # one read of a device tensor's changed elements
        if parts:
            pos, d = np.concatenate([p for p, _ in parts]), np.concatenate([x for _, x in parts])
            old = slots[tid].gather(pos)
            new = old + unzigzag(d)
            hash_delta[tid] = keys[tid].change(pos, old, new)
            staged.append(_Staged(slots[tid], pos, old, new))

    for spec, t, c, h in zip(delta.tensors, m["tensors"], changed, hash_delta):
        if c != t["changed"] or format_hash(h) != t["hash_delta"]:
            raise VerifyError(
                f"tensor '{spec.name}': staged changes ({c} elements, hash delta {format_hash(h)}) "
                f"differ from the manifest ({t['changed']}, {t['hash_delta']})"
            )
    target = format_hash(parse_hash(have) + sum(hash_delta))
    if target != m["target_hash"]:
        raise VerifyError(f"target hash mismatch: manifest promises {m['target_hash']}, staged result is {target}")

    done: list[_Staged] = []
    try:
        for s in staged:
            s.slot.scatter(s.positions, s.new)  # on a device this can fail midway (memory, a lost GPU)
            done.append(s)
    except BaseException:
        for s in done:
            s.slot.scatter(s.positions, s.old)
        raise
    if verify_full:
        full = hash_through(delta.tensors, slot_of)
        if full != target:
            for s in staged:
                s.slot.scatter(s.positions, s.old)
            raise VerifyError(f"full state hash after apply is {full}, expected {target}; rolled back")
    return target
