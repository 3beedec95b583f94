"""Tensor-name mapping: apply trainer-layout deltas into a fused receiver layout (qkv_proj)."""

import io

import numpy as np
import pytest
import torch
from support.tensors import mutate, mutated, random_tensor

from sparrowrl.delta import DeltaFile, Slot, apply_delta, state_hash, write_delta
from sparrowrl.delta.apply import DeviceSlot, hash_through
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.errors import VerifyError


def test_apply_into_fused_qkv(rng):
    q, k, v = (random_tensor(rng, "BF16", (n, 16)) for n in (32, 8, 8))
    old = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v}
    new = mutated(rng, old, 0.05)
    buf = io.BytesIO()
    write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1, segment=100)

    qkv = torch.cat([q, k, v]).contiguous()  # the receiver's fused parameter
    offsets = {"q_proj.weight": 0, "k_proj.weight": q.numel(), "v_proj.weight": q.numel() + k.numel()}

    def slot_of(spec):
        return Slot(bits(qkv), offsets[spec.name])

    delta = DeltaFile(buf.getvalue())
    assert hash_through(delta.tensors, slot_of) == state_hash(old)
    h = apply_delta(delta, slot_of=slot_of, verify_full=True)

    want = torch.cat([new["q_proj.weight"], new["k_proj.weight"], new["v_proj.weight"]])
    assert np.array_equal(bits(qkv), bits(want))
    assert h == state_hash(new)


def test_apply_through_device_slots(rng):
    """The accelerator route (one gather and one scatter of the changed elements per tensor,
    as torch ops), run here on CPU tensors; tests/test_gpu.py runs it on CUDA."""
    q, k, v = (random_tensor(rng, "BF16", (n, 16)) for n in (32, 8, 8))
    old = {"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v}
    new = {n: mutate(rng, t, d) for (n, t), d in zip(old.items(), (0.05, 1.0, 0.0))}
    buf = io.BytesIO()
    write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1, segment=100)

    qkv = torch.cat([q, k, v]).contiguous()
    offsets = {"q_proj.weight": 0, "k_proj.weight": q.numel(), "v_proj.weight": q.numel() + k.numel()}

    def slot_of(spec):
        return DeviceSlot(qkv.view(-1).view(torch.int16), offsets[spec.name])

    h = apply_delta(DeltaFile(buf.getvalue()), slot_of=slot_of, verify_full=True)
    assert np.array_equal(bits(qkv), bits(torch.cat(list(new.values()))))
    assert h == state_hash(new)


@pytest.mark.parametrize("device", [False, True])
def test_a_wrong_layout_is_caught_by_the_full_hash_and_rolled_back(rng, device):
    """k and v mapped onto the same rows by mistake: with equal old values every check before the
    assignment passes, the full hash afterwards does not, and the rows get their old bits back."""
    k = random_tensor(rng, "BF16", (8, 16))
    old = {"k_proj.weight": k, "v_proj.weight": k.clone()}
    new = mutated(rng, old, 0.3)
    buf = io.BytesIO()
    write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1)
    rows = k.clone()
    flat = rows.view(-1).view(torch.int16) if device else bits(rows)

    def slot_of(spec):
        return (DeviceSlot if device else Slot)(flat, 0)

    with pytest.raises(VerifyError, match="rolled back"):
        apply_delta(DeltaFile(buf.getvalue()), slot_of=slot_of, verify_full=True)
    assert np.array_equal(bits(rows), bits(k))
