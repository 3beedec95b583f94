"""Fuzz the decoder: whatever the bytes, it raises only the codec's own errors (or succeeds)."""

import hashlib
import io

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.tensors import mutate, random_tensor

from sparrowrl.delta import DeltaFile, apply_delta, kernels, state_hash, write_delta
from sparrowrl.delta.bitview import bits
from sparrowrl.delta.entropy import Cursor
from sparrowrl.delta.errors import DeltaError
from sparrowrl.delta.frame import HEAD, MAGIC, TRAILER
from sparrowrl.delta.records import decode_record, encode_changes, extract_segment

_rng = np.random.default_rng(7)
OLD = {"a": random_tensor(_rng, "BF16", (64, 64)), "b": random_tensor(_rng, "F32", (300,))}
NEW = {"a": mutate(_rng, OLD["a"], 0.03), "b": mutate(_rng, OLD["b"], 0.9)}
VALID = {}  # per format version
for _v in (1, 2, 3):
    _buf = io.BytesIO()
    write_delta(
        _buf,
        OLD,
        NEW,
        base_version=0,
        base_hash=state_hash(OLD),
        target_version=1,
        segment=512,
        chunk_bytes=300,
        version=_v,
    )
    VALID[_v] = _buf.getvalue()

# record bodies of every kind and codec, to mutate beneath the chunk checksums; each context
# record decodes against the base it was made from (tensor 0), or a base of another tensor's
SIZES, NUMELS, FIELDS = [2, 4], [4096, 300], [(7, 0xFF), (23, 0xFF)]
BASES = [bits(random_tensor(_rng, "BF16", (4096,))), bits(random_tensor(_rng, "F32", (300,)))]
BODIES = []  # (format version, record)
for density in (0.002, 0.02, 0.3, 1.0):
    ch = extract_segment(
        0,
        BASES[0],
        bits(mutate(_rng, torch.from_numpy(BASES[0].view(np.int16)).view(torch.bfloat16), density)),
        FIELDS[0],
    )
    BODIES += [(v, encode_changes(0, ch, v)) for v in (1, 2, 3)]


def locate(tid, start, length, *found):
    return kernels.class_locate(BASES[tid][start : start + length], *FIELDS[tid], *found)


settings_ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def attempt(data: bytes) -> None:
    """Refused: nothing changed. Applied (a mutation the format does not read): exactly NEW."""
    state = {k: v.clone() for k, v in OLD.items()}
    try:
        apply_delta(DeltaFile(data), state)
    except DeltaError:
        want = OLD
    else:
        want = NEW
    for k in OLD:
        assert torch.equal(bits_t(state[k]), bits_t(want[k]))


def bits_t(t):
    return torch.from_numpy(bits(t).copy())


@settings_
@given(
    version=st.sampled_from([1, 2, 3]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_files(version, edits, cut):
    data = bytearray(VALID[version])
    for at, val in edits:
        data[at % len(data)] = val
    attempt(bytes(data[: cut % (len(data) + 1)] if cut is not None else data))


@settings_
@given(data=st.binary(max_size=2000))
def test_arbitrary_files(data):
    attempt(data)


@settings_
@given(
    part=st.sampled_from(["header", "manifest"]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_packed_json_whose_digests_are_made_to_agree(part, edits, cut):
    """Format 3 packs its header and manifest: mutated, with their digests recomputed, so that
    unpacking and validation are what refuse them (or they still read as the same delta)."""
    data = VALID[3]
    _, version, n = HEAD.unpack_from(data)
    off, length, _, end = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    lo, hi = (HEAD.size, HEAD.size + n) if part == "header" else (off, off + length)
    stored = bytearray(data[lo:hi])
    for at, val in edits:
        stored[at % len(stored)] = val
    stored = bytes(stored[: cut % (len(stored) + 1)] if cut is not None else stored)
    if part == "header":
        forged = HEAD.pack(MAGIC, version, len(stored)) + stored + hashlib.sha256(stored).digest() + data[hi + 32 :]
    else:
        forged = data[:off] + stored + TRAILER.pack(off, len(stored), hashlib.sha256(stored).digest(), end)
    attempt(forged)


def decode_all(body: bytes, version: int) -> None:
    cur = Cursor(body, "fuzz")
    try:
        while cur.pos < len(cur.buf):
            decode_record(cur, SIZES, NUMELS, version, locate)
    except DeltaError:
        pass


@settings_
@given(
    which=st.integers(0, len(BODIES) - 1),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_mutated_records_beneath_checksums(which, edits, cut):
    version, body = BODIES[which][0], bytearray(BODIES[which][1])
    for at, val in edits:
        body[at % len(body)] = val
    decode_all(bytes(body[:cut] if cut is not None else body), version)


@settings_
@given(data=st.binary(max_size=600), version=st.sampled_from([2, 3]))
def test_arbitrary_records(data, version):
    decode_all(data, version)


def test_many_seeded_mutations_beneath_checksums():
    """Hypothesis explores; this sweeps wide: thousands of random 1-3 byte edits per record kind."""
    rng = np.random.default_rng(0)
    for i in range(8000):
        version, body = BODIES[i % len(BODIES)][0], bytearray(BODIES[i % len(BODIES)][1])
        for _ in range(rng.integers(1, 4)):
            body[rng.integers(len(body))] = rng.integers(256)
        decode_all(bytes(body), version)


@settings_
@given(
    st.lists(st.integers(0, 10**6), min_size=2, max_size=256),
    st.integers(0, 2**32 - 1),
    st.integers(0, 3),
    st.integers(0, 2**31),
)
def test_the_ans_decoder_is_constrictions_bit_for_bit(counts, seed, damage, where):
    """Our GIL-free ANS decoder against the library that encodes: the same symbols from every
    stream it wrote, and the same verdict (decoded, bits left, refused) on damaged streams."""
    import constriction

    from sparrowrl.delta import kernels

    counts = np.array(counts, np.int64)
    counts[-1] = max(counts[-1], 1)  # the table's last symbol is used, as _trim makes it
    rng = np.random.default_rng(seed)
    sym = rng.choice(len(counts), int(min(counts.sum(), 3000)), p=counts / counts.sum())
    model = constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)
    coder = constriction.stream.stack.AnsCoder()
    coder.encode_reverse(sym.astype(np.int32), model)
    words = coder.get_compressed().astype(np.uint32)
    if damage and len(words):  # a flipped bit, or the stream cut short
        words = words.copy()
        if damage == 1:
            words[where % len(words)] ^= np.uint32(1 << (where % 32))
        else:
            words = words[where % len(words) :]
    got, status = kernels.ans_decode(words, kernels.ans_cdf(counts)[None, :], np.array([len(sym)], np.int64))
    try:
        ref = constriction.stream.stack.AnsCoder(words)
        want, verdict = ref.decode(model, len(sym)), 0
        verdict = 0 if ref.is_empty() else 1
    except BaseException:  # constriction refuses a stack whose top word is zero
        want, verdict = None, 2
    assert status == verdict
    if want is not None:
        assert np.array_equal(got, want)
    if not damage:
        assert status == 0 and np.array_equal(got, sym)


def _counts(rng: np.random.Generator, zeros: float, top: int) -> np.ndarray:
    """A model's 256 counts: up to `top`, a share `zeros` of them zero."""
    counts = rng.integers(0, top + 1, 256)
    counts[rng.random(256) < zeros] = 0
    return counts


@settings_
@given(
    st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 0.99, 1.0]), st.sampled_from([1, 3, 1000, 10**6]), st.integers(0, 400)),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, 2**32 - 1),
)
def test_the_ans_encoder_is_constrictions_bit_for_bit(runs, seed):
    """Our GIL-free ANS encoder against the library: the same words for runs of symbols, each
    run over its own model (zero counts included: every symbol keeps a width of at least 1),
    and our decoder gives the symbols back. The counts come from the seed: 256 integers drawn by
    hypothesis per model made this test take a minute."""
    import constriction

    from sparrowrl.delta import kernels

    rng = np.random.default_rng(seed)
    models, syms = [], []
    for zeros, top, n in runs:
        counts = _counts(rng, zeros, top)
        counts[-1] += 1  # never all zero
        models.append(counts)
        syms.append(rng.choice(256, n, p=counts / counts.sum()) if rng.random() < 0.8 else rng.integers(0, 256, n))
    coder = constriction.stream.stack.AnsCoder()
    for counts, sym in reversed(list(zip(models, syms))):
        coder.encode_reverse(
            sym.astype(np.int32), constriction.stream.model.Categorical(counts.astype(np.float64), perfect=False)
        )
    cdfs = np.stack([kernels.ans_cdf(c) for c in models])
    lengths = np.array([len(x) for x in syms], np.int64)
    words = kernels.ans_encode(np.concatenate(syms).astype(np.int64), cdfs, lengths)
    assert np.array_equal(words, coder.get_compressed().astype(np.uint32))
    back, status = kernels.ans_decode(words, cdfs, lengths)
    assert status == 0 and np.array_equal(back, np.concatenate(syms))
