"""The streaming encoder puts the first chunks out before later tensors are even diffed."""

import hashlib
import io
import struct

from support.tensors import mutated, random_tensor

from sparrowrl.delta import DeltaFile, DeltaWriter, apply_delta, state_hash
from sparrowrl.delta.frame import CHUNK, HEAD
from sparrowrl.delta.tensors import TensorSpec


class Tap(io.BytesIO):
    """An output that records how many bytes had been flushed at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed: list[int] = []

    def flush(self):
        self.flushed.append(len(self.getvalue()))


def test_chunks_are_on_the_wire_before_the_last_tensor_is_added(rng):
    old = {f"layer{i}": random_tensor(rng, "BF16", (200, 50)) for i in range(4)}
    new = mutated(rng, old, 0.05)
    out = Tap()
    w = DeltaWriter(
        out,
        [TensorSpec.of(n, t) for n, t in new.items()],
        base_version=0,
        base_hash=state_hash(old),
        target_version=1,
        chunk_bytes=512,
    )
    w.add([("layer0", old["layer0"], new["layer0"])])
    early = out.getvalue()
    assert out.flushed, "nothing flushed after the first tensor"
    # the bytes out so far are a header and whole chunks, each verifiable by its own digest
    _, _, n = HEAD.unpack_from(early)
    pos = HEAD.size + n + 32
    chunks = 0
    while pos < len(early):
        magic, index, length, digest = CHUNK.unpack_from(early, pos)
        body = early[pos + CHUNK.size : pos + CHUNK.size + length]
        assert magic == b"SPCK" and index == chunks
        assert hashlib.sha256(struct.pack("<II", index, length) + body).digest() == digest
        pos += CHUNK.size + length
        chunks += 1
    assert chunks >= 1 and pos == len(early)
    w.add((n, old[n], new[n]) for n in ["layer1", "layer2", "layer3"])
    m = w.close()
    assert out.getvalue().startswith(early)
    state = {k: v.clone() for k, v in old.items()}
    assert apply_delta(DeltaFile(out.getvalue()), state) == m["target_hash"] == state_hash(new)
