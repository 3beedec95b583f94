"""Bad input: a clear error naming the problem, and the receiver's weights untouched."""

import io
import struct

import numpy as np
import pytest
import torch
from conftest import zstd_frame
from support.tensors import mutate, mutated, random_tensor

from sparrowrl.delta import DeltaFile, apply_delta, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.errors import CorruptError, DeltaError, FormatError, MismatchError, VerifyError
from sparrowrl.delta.frame import CHUNK, HEAD, MAX_JSON, TRAILER, pack_json, unpack_json


@pytest.fixture
def pair(rng):
    old = {"a": random_tensor(rng, "BF16", (300, 40)), "b": random_tensor(rng, "F32", (1000,))}
    new = {"a": mutate(rng, old["a"], 0.02), "b": mutate(rng, old["b"], 0.5)}
    buf = io.BytesIO()
    m = write_delta(
        buf, old, new, base_version=0, base_hash=state_hash(old), target_version=1, segment=2048, chunk_bytes=256
    )
    assert len(m["chunks"]) >= 3
    return old, new, buf.getvalue(), m


def assert_refused(data: bytes, old: dict, exc=DeltaError, match: str | None = None):
    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises(exc, match=match):
        apply_delta(DeltaFile(data), state)
    for k in old:
        assert np.array_equal(bits(state[k]), bits(old[k])), f"{k} was modified by a refused delta"


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x10
    return bytes(b)


def test_corruption_anywhere_is_refused(pair):
    old, _, data, m = pair
    regions = {
        "header": HEAD.size + 5,
        "manifest": m["chunks"][-1]["offset"] + m["chunks"][-1]["length"] + 10,
        "trailer": len(data) - 20,
    }
    for i, c in enumerate(m["chunks"]):
        regions[f"chunk {i} header"] = c["offset"] + 5
        regions[f"chunk {i} body"] = c["offset"] + CHUNK.size + (c["length"] - CHUNK.size) // 2
    for at in regions.values():
        assert_refused(flip(data, at), old)


def test_every_byte_position_is_covered(pair):
    """Flip each byte of a small delta in turn: each one is caught."""
    old, _, data, _ = pair
    for at in range(0, len(data), max(1, len(data) // 400)):
        assert_refused(flip(data, at), old)


@pytest.mark.parametrize("cut", [0, 5, 20, 100, -1, -30, -60])
def test_truncation(pair, cut):
    old, _, data, _ = pair
    with pytest.raises((FormatError, CorruptError)):
        DeltaFile(data[:cut])


def test_truncated_download_says_so(pair):
    _, _, data, _ = pair
    with pytest.raises(FormatError, match="end marker missing"):
        DeltaFile(data[:-1])


def test_unknown_format_version(pair):
    _, _, data, _ = pair
    bad = data[:8] + struct.pack("<I", 99) + data[12:]
    with pytest.raises(FormatError, match="unsupported format version 99"):
        DeltaFile(bad)


def test_not_a_delta():
    with pytest.raises(FormatError, match="bad magic"):
        DeltaFile(b"PK\x03\x04" + bytes(200))


def test_wrong_base(pair, rng):
    old, _, data, m = pair
    other = mutated(rng, old, 0.001)
    assert_refused(data, other, MismatchError, f"base hash mismatch: delta needs {m['base_hash']}")


def test_wrong_tracked_base_hash(pair):
    old, _, data, _ = pair
    state = {k: v.clone() for k, v in old.items()}
    with pytest.raises(MismatchError, match="base hash mismatch"):
        apply_delta(DeltaFile(data), state, base_hash="0123456789abcdef")


def test_shape_and_dtype_mismatch(pair):
    old, _, data, _ = pair
    reshaped = dict(old, a=old["a"].reshape(40, 300))
    assert_refused(
        data, reshaped, MismatchError, r"tensor 'a': delta expects BF16\[300, 40\], base has BF16\[40, 300\]"
    )
    retyped = dict(old, b=old["b"].to(torch.float64))
    assert_refused(data, retyped, MismatchError, r"tensor 'b': delta expects F32\[1000\], base has F64\[1000\]")


def test_missing_and_extra_tensors(pair):
    old, _, data, _ = pair
    assert_refused(data, {"a": old["a"]}, MismatchError, "tensor 'b' is in the delta but not in the base")
    assert_refused(data, dict(old, c=torch.zeros(3)), MismatchError, "tensor 'c' is in the base but not in the delta")


def test_lying_manifest_is_caught_before_any_write(pair):
    """Re-sign a manifest whose target hash is wrong: staging catches it, nothing changes."""
    old, _, data, m = pair
    forged = resign_manifest(data, lambda m: m.update(target_hash="%016x" % (int(m["target_hash"], 16) ^ 1)))
    assert_refused(forged, old, VerifyError, "target hash mismatch")


def resign_manifest(data: bytes, edit=None, raw: bytes | None = None) -> bytes:
    """A manifest edited (or replaced by `raw` as stored) and re-signed: checksums pass, so only
    validation can catch it."""
    import hashlib
    import json

    version = HEAD.unpack_from(data)[1]
    off, length, _, end = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    if raw is None:
        manifest = json.loads(unpack_json(data[off : off + length], version))
        edit(manifest)
        raw = pack_json(manifest, version)
    return data[:off] + raw + TRAILER.pack(off, len(raw), hashlib.sha256(raw).digest(), end)


def test_a_packed_manifest_that_would_unpack_beyond_its_bound_is_refused_unread(pair):
    """zstd frames declare their size and the library allocates it: a few bytes that declare a
    terabyte must be refused, not tried."""
    import zstandard

    _, _, data, _ = pair
    raw = zstd_frame(1 << 40, b"{}")
    assert zstandard.get_frame_parameters(raw).content_size == 1 << 40
    with pytest.raises(
        CorruptError, match=f"manifest: does not unpack: declares {1 << 40} bytes unpacked \\(bound {MAX_JSON}\\)"
    ):
        DeltaFile(resign_manifest(data, raw=raw))
    with pytest.raises(CorruptError, match="manifest: does not unpack"):
        DeltaFile(resign_manifest(data, raw=b"{}"))  # format 3 stores it packed; bare JSON is not
    version = HEAD.unpack_from(data)[1]
    off, length, _, _ = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    packed = data[off : off + length]
    with pytest.raises(CorruptError, match="manifest: does not unpack: its zstd frame is followed by 3 bytes"):
        DeltaFile(resign_manifest(data, raw=packed + b"xyz"))
    with pytest.raises(CorruptError, match="manifest: does not unpack: its zstd frame is cut short"):
        DeltaFile(resign_manifest(data, raw=packed[:-4]))
    # a frame that holds more than it declares: a 10 MB frame whose size field says 200 bytes
    big = bytearray(zstandard.ZstdCompressor().compress(pack_json({"x": "y" * 10**7}, 1)))
    assert big[4] >> 6 == 2 and not big[4] & 0x20  # a 4-byte size field after the window byte
    big[6:10] = (200).to_bytes(4, "little")
    assert zstandard.get_frame_parameters(bytes(big)).content_size == 200 and version == 3
    with pytest.raises(CorruptError, match="manifest: does not unpack"):
        DeltaFile(resign_manifest(data, raw=bytes(big)))
    with pytest.raises(CorruptError, match="manifest: does not unpack"):  # and one that holds less
        DeltaFile(resign_manifest(data, raw=zstd_frame(100, b"{}")))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("base_version"), "manifest: base_version: Field required"),
        (lambda m: m.update(chunks={}), "manifest: chunks: Input should be a valid array"),
        (lambda m: m["chunks"][0].update(offset=40.0), "manifest: chunks.0.offset: Input should be a valid integer"),
        (lambda m: m["chunks"][0].pop("sha256"), "manifest: chunks.0.sha256: Field required"),
        (lambda m: m["tensors"][0].update(changed="7"), "manifest: tensors.0.changed: Input should be a valid integer"),
        (lambda m: m["tensors"][0].update(changed=10**9), "claims 1000000000 changes of 12000 elements"),
        (lambda m: m.update(target_hash="XYZ"), "manifest: target_hash: String should match pattern"),
        (lambda m: m.update(extra=1), "manifest: extra: Extra inputs are not permitted"),
    ],
)
def test_forged_manifests_are_named(pair, edit, message):
    old, _, data, _ = pair
    with pytest.raises(CorruptError, match=message.replace(".", r"\.").replace("(", r"\(")):
        DeltaFile(resign_manifest(data, edit))


def test_forged_header_with_absurd_shape(pair):
    import hashlib
    import json

    _, _, data, _ = pair
    _, version, n = HEAD.unpack_from(data)
    header = json.loads(unpack_json(data[HEAD.size : HEAD.size + n], version))
    header["tensors"][0][2] = [2**40, 2**40]
    raw = pack_json(header, version)
    forged = HEAD.pack(b"SPRWDLTA", version, len(raw)) + raw + hashlib.sha256(raw).digest() + data[HEAD.size + n + 32 :]
    with pytest.raises(CorruptError, match="header: .*elements \\(limit"):
        DeltaFile(forged)


def test_base_tensors_are_views_of_the_pulled_bytes(rng):
    """A pulled base becomes tensors without a copy; a tensor whose bytes are not aligned to its
    item size (possible in a hand-written file) is copied out, and every value survives."""
    from safetensors.torch import save

    from sparrowrl.store.checkpoint_io import tensors_in

    state = {
        "a": random_tensor(rng, "BF16", (3, 5)),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.zeros(0),
        "d": torch.tensor(3.0),
    }
    buf = bytearray(save(state))
    got = tensors_in(buf)
    assert state_hash(got) == state_hash(state)
    assert all(got[k].dtype == state[k].dtype and got[k].shape == state[k].shape for k in state)
    got["b"][0] = 42  # a view: the buffer changes with it
    assert tensors_in(buf)["b"][0] == 42
    header = b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}}'
    odd = bytearray(struct.pack("<Q", len(header)) + header + bytes(range(10)))
    assert tensors_in(odd)["x"].view(torch.uint8).tolist() == list(range(1, 9))


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "at bytes 0..8"),  # shape needs 16 bytes
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 64]}, "at bytes 0..64"),  # past the end
        ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "at bytes 0..8"),
        ({"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}, "unreadable entry"),
        ({"shape": [2], "data_offsets": [0, 8]}, "unreadable entry"),
    ],
)
def test_a_base_with_a_lying_header_is_refused(entry, message):
    import json

    from sparrowrl.store.checkpoint_io import CheckpointError, tensors_in

    header = json.dumps({"x": entry}).encode()
    with pytest.raises(CheckpointError, match=f"tensor 'x'.*{message}"):
        tensors_in(bytearray(struct.pack("<Q", len(header)) + header + bytes(16)))
    with pytest.raises(CheckpointError, match="header of"):
        tensors_in(bytearray(struct.pack("<Q", 1 << 40) + header))
