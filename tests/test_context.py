"""Format 2's context coding: changes found again in the base they were coded against, on the
host and with the device route's torch code (run here on CPU tensors); format 1 still read."""

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from support.tensors import adam_step_pair, random_tensor

from sparrowrl.delta import DeltaFile, apply_delta, kernels, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.context import FIELDS, field, locate_on_device, ranks_on_device
from sparrowrl.delta.encoder import Encoder
from sparrowrl.delta.entropy import Cursor
from sparrowrl.delta.errors import CorruptError, DeltaError, MismatchError
from sparrowrl.delta.frame import DeltaWriter
from sparrowrl.delta.records import decode_record, encode_changes, extract_segment
from sparrowrl.delta.tensors import TensorSpec

FORMAT1 = Path(__file__).parent / "data" / "format1"


def grouped(cls: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What the decoder gets from a record: the classes present, their counts, the gaps between
    ranks within each class (in class order), and that order."""
    order = np.argsort(cls, kind="stable")
    sizes = np.bincount(cls, minlength=256)
    counts = sizes[sizes > 0]
    r = rank[order]
    gaps = np.diff(r, prepend=-1) - 1
    starts = np.cumsum(counts) - counts
    gaps[starts] = r[starts]
    return np.flatnonzero(sizes).astype(np.uint8), counts, gaps, order


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(["BF16", "F16", "F32", "I32", "F8_E4M3"]),
    n=st.integers(1, 3000),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_ranks_locate_back_to_the_positions_on_host_and_device_route(dtype, n, density, seed):
    rng = np.random.default_rng(seed)
    base = random_tensor(rng, dtype, (n,))
    flat = bits(base)
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    fld = field(dtype)
    after = flat.copy()
    after[positions] ^= 1
    found, _, _, cls, rank = kernels.changed(flat, after, fld)
    assert np.array_equal(found, positions)
    signed = torch.from_numpy(flat.view({1: np.int8, 2: np.int16, 4: np.int32}[flat.itemsize]))
    dcls, drank = ranks_on_device(signed, fld, positions)
    assert np.array_equal(cls, dcls) and np.array_equal(rank, drank)
    if not len(positions):  # records hold at least one change
        return
    assert cls.max() <= fld[1]
    classes, counts, gaps, order = grouped(cls, rank)
    for where in (
        lambda: kernels.class_locate(flat, *fld, classes, counts, gaps),
        lambda: locate_on_device(signed, fld, classes, counts, gaps),
    ):
        pos, src, found = where()
        assert found and np.array_equal(pos, positions) and np.array_equal(order[src], np.arange(len(positions)))
    # a change past its class's last element is not found, on either route
    size = np.count_nonzero(((flat >> fld[0]) & fld[1]) == classes[0])
    gaps[counts[0] - 1] += size - rank[order][counts[0] - 1]
    assert not kernels.class_locate(flat, *fld, classes, counts, gaps)[2]
    assert not locate_on_device(signed, fld, classes, counts, gaps)[2]


def iid_bound(old: torch.Tensor, new: torch.Tensor) -> float:
    """Bytes per change of an ideal coder that treats every element alike (format 1's model):
    Bernoulli positions and the empirical entropy of the differences."""
    a, b = bits(old), bits(new)
    changed = a != b
    k, n = int(changed.sum()), len(a)
    p = k / n
    _, c = np.unique(b[changed] - a[changed], return_counts=True)
    q = c / k
    return (n * -(p * np.log2(p) + (1 - p) * np.log2(1 - p)) - k * (q * np.log2(q)).sum()) / 8 / k


@pytest.mark.parametrize("lr", [1e-6, 1e-5])
def test_an_adam_step_costs_less_than_any_context_free_coder_could(lr):
    """The point of format 2: on a realistic step it beats the entropy bound of coding every
    element alike, which format 1 sat within 1-2% of."""
    old, new = adam_step_pair(np.random.default_rng(5), 1 << 20, lr)
    buf = io.BytesIO()
    m = write_delta(buf, {"w": old}, {"w": new}, base_version=0, base_hash=state_hash({"w": old}), target_version=1)
    per_change = len(buf.getvalue()) / m["changed"]
    assert per_change < 0.9 * iid_bound(old, new)
    state = {"w": old.clone()}
    assert apply_delta(DeltaFile(buf.getvalue()), state, verify_full=True) == state_hash({"w": new})


@pytest.mark.parametrize("version", [1, 2])
def test_deltas_of_earlier_formats_stay_readable(version):
    """Each written by the code of its time, over the same states (format 1's folder holds them)."""
    old, new = load_file(FORMAT1 / "old.safetensors"), load_file(FORMAT1 / "new.safetensors")
    d = DeltaFile((FORMAT1.parent / f"format{version}" / "delta.bin").read_bytes())
    assert d.version == version and d.summary()["format"] == version
    state = {k: v.clone() for k, v in old.items()}
    assert apply_delta(d, state, verify_full=True) == state_hash(new)
    for k in new:
        assert np.array_equal(bits(state[k]), bits(new[k])), k
    buf = io.BytesIO()  # what is written now is format 3, and smaller
    write_delta(buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1)
    assert DeltaFile(buf.getvalue()).version == 3 and len(buf.getvalue()) < len(d.data)


def test_a_context_record_in_a_format_1_file_is_refused(rng):
    a = random_tensor(rng, "BF16", (4096,))
    b = a.clone()
    bits(b)[::50] += 1
    body = encode_changes(0, extract_segment(0, bits(a), bits(b), FIELDS["BF16"]), 2)

    def locate(tid, start, length, *f):
        return kernels.class_locate(bits(a)[start : start + length], 7, 0xFF, *f)

    assert decode_record(Cursor(body, "ok"), [2], [4096], 2, locate).count == 82
    with pytest.raises(CorruptError, match="unknown record kind 3"):
        decode_record(Cursor(body, "old"), [2], [4096], 1, locate)


def test_format_3_record_headers_are_bounded_integers(rng):
    """Its headers are LEB128: one that never ends, or names a segment past its tensor, is refused
    by name; the same record with format 2's fixed header decodes alike, 29 bytes larger."""
    a = random_tensor(rng, "BF16", (4096,))
    b = a.clone()
    bits(b)[::50] += 1
    ch = extract_segment(0, bits(a), bits(b), FIELDS["BF16"])
    body, old_body = encode_changes(0, ch, 3), encode_changes(0, ch, 2)

    def locate(tid, start, length, *f):
        return kernels.class_locate(bits(a)[start : start + length], 7, 0xFF, *f)

    got = decode_record(Cursor(body, "r"), [2], [4096], 3, locate)
    old_got = decode_record(Cursor(old_body, "r"), [2], [4096], 2, locate)
    assert np.array_equal(got.positions, old_got.positions) and np.array_equal(got.diffs, old_got.diffs)
    assert len(old_body) - len(body) == 29
    with pytest.raises(CorruptError, match="integer at offset 9 longer than 9 bytes"):
        decode_record(Cursor(b"\xff" * 12 + body[1:], "r"), [2], [4096], 3, locate)
    past = bytearray(body)
    past[4] = 0x7F  # start: 127 of a 4096-element tensor whose segment is 4096 long
    with pytest.raises(CorruptError, match=r"segment \[127, 4223\) outside tensor 0 of 4096 elements"):
        decode_record(Cursor(bytes(past), "r"), [2], [4096], 3, locate)
    with pytest.raises(CorruptError, match="integer at offset 2 not in its shortest form"):
        decode_record(Cursor(b"\x80\x00" + body[1:], "r"), [2], [4096], 3, locate)  # tensor id 0 in two bytes
    sparse = bytearray(body)
    sparse[1] = 1  # format 1's record kind: formats 2 and 3 never write it
    with pytest.raises(CorruptError, match="unknown record kind 1"):
        decode_record(Cursor(bytes(sparse), "r"), [2], [4096], 3, locate)


def test_a_writer_takes_records_of_its_own_format_only(rng):
    """A sharded trainer's ranks encode records for rank 0's writer: an encoder of another format
    would make a file that no reader decodes, so the writer refuses its records."""
    a = random_tensor(rng, "BF16", (64, 64))
    b = a.clone()
    bits(b)[::7] += 1
    spec = TensorSpec.of("w", a)
    old_format = Encoder([spec], version=2)
    records = [e for e in old_format.encode([(0, 0, a, b)]) if e.data]
    old_format.close()
    w = DeltaWriter(io.BytesIO(), [spec], base_version=0, base_hash=state_hash({"w": a}), target_version=1)
    with pytest.raises(MismatchError, match="a record of format 2 for a format 3 delta"):
        w.add_encoded("w", [(0, a.numel())], records)
    w.encoder.close()


def test_a_delta_applied_to_another_base_that_claims_its_hash_changes_nothing(rng):
    """A receiver whose tracked hash is wrong (its memory is not what it thinks): positions are
    found in the wrong base, and the staged hash or the class walk refuses it before any write."""
    old, new = adam_step_pair(rng, 1 << 16, 1e-5)
    buf = io.BytesIO()
    m = write_delta(buf, {"w": old}, {"w": new}, base_version=0, base_hash=state_hash({"w": old}), target_version=1)
    other = old.clone()
    bits(other)[: 1 << 15] = bits(old)[1 << 15 :]  # the same values, elsewhere
    before = bits(other).copy()
    with pytest.raises(DeltaError):
        apply_delta(DeltaFile(buf.getvalue()), {"w": other}, base_hash=m["base_hash"])
    assert np.array_equal(bits(other), before)
