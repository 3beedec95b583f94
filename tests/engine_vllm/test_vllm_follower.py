"""The vLLM backend's fetch thread (`_Follower`) against a real origin, without starting vLLM:
it outlives an outage and a pruned delta chain, an update fails on a fetch that fails while it
waits but not on one that failed before, and it stages at most MAX_STAGED versions ahead while
an update further ahead still gets there."""

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM lives in its own venv: make test-vllm")

from support.servers import TOKEN  # noqa: E402
from support.tensors import bf16  # noqa: E402
from support.wait import until  # noqa: E402

from sparrowrl.auth import pki  # noqa: E402
from sparrowrl.delta import state_hash  # noqa: E402
from sparrowrl.integrations.vllm_backend import CA_ENV, MAX_STAGED, _Follower, trusting_env  # noqa: E402
from sparrowrl.sync import Origin, Publisher, Subscriber  # noqa: E402


def weights() -> dict[str, torch.Tensor]:
    """The trainer's fp32 tensors."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def step(w: dict[str, torch.Tensor]) -> None:
    for t in w.values():
        t.add_(torch.randn_like(t) * 0.1)


def follower(url: str, w: dict[str, torch.Tensor]) -> _Follower:
    """A follower whose tensors hold v0 (the trainer's bf16 cast), as a server started from it."""
    held = bf16(w)
    return _Follower(Subscriber([url], held, held=0, token=TOKEN, attempts=2))


def update(f: _Follower, target: int) -> list[list[int]]:
    """What `receive_weights` does with the follower; returns the versions of each take."""
    deadline, since, takes, whole = time.monotonic() + 60, f.failures, [], False
    while not whole:
        chain, whole = f.take(target, deadline, since)
        takes.append([s.version for s in chain])
        for s in chain:
            f.sub.apply(s)
            f.done(s.version)
    return takes


@pytest.mark.timeout(180)
def test_follower_outlives_an_outage_and_a_pruned_chain(tmp_path):
    w = weights()
    pub = Publisher(w, tmp_path / "store", base_every=2)
    origin = pub.serve(TOKEN)
    port = int(origin.url.rsplit(":", 1)[1])
    origin.close()  # down before the follower's first request: one in flight at the close was seen
    # to hang until the client's read timeout (60 s with a long poll's wait)
    f = follower(origin.url, w)
    try:
        until(lambda: f.failures >= 1, 60, "the follower's first failed fetch")
        # a fetch that fails while the update waits fails it (the follower retries every RETRY_S)
        with pytest.raises(RuntimeError, match="is not fetched: from"):
            f.take(1, time.monotonic() + 60, f.failures)
        for _ in range(5):  # published while the origin is down; v0..v3 and v4's delta pruned
            step(w)
            pub.publish()
        assert pub.store.prune(1) == [0, 1, 2, 3]
        origin = Origin(pub.store.path, TOKEN, port=port)
        step(w)
        assert pub.publish() == 6  # after the recovery
        # the failures before it do not fail this update, and the follower takes a base, not v1's delta
        takes = update(f, 6)
        assert takes[0][0] in (5, 6) and f.sub.version == 6, takes
        assert f.sub.state_hash == pub.state_hash == state_hash(bf16(w))
    finally:
        f.stop()
        origin.close()


@pytest.mark.timeout(180)
def test_follower_stages_a_bounded_number_ahead_and_an_update_further_ahead_gets_there(tmp_path):
    w = weights()
    pub = Publisher(w, tmp_path / "store")
    n = MAX_STAGED + 3
    with pub.serve(TOKEN) as origin:
        f = follower(origin.url, w)
        try:
            for _ in range(n):
                step(w)
                pub.publish()
            until(lambda: len(f.staged) == MAX_STAGED, 60, f"{MAX_STAGED} versions staged")
            time.sleep(0.5)  # time to stage more, were there no bound
            assert sorted(f.staged) == list(range(1, MAX_STAGED + 1)) and f.known == MAX_STAGED
            takes = update(f, n)
            assert takes[0] == list(range(1, MAX_STAGED + 1)) and sum(takes, []) == list(range(1, n + 1)), takes
            assert (f.sub.version, f.sub.state_hash) == (n, pub.state_hash) and not f.staged
        finally:
            f.stop()


@pytest.mark.timeout(120)
def test_the_backend_trusts_the_ca_it_is_given_alone(tmp_path, monkeypatch):
    """SPARROWRL_CA_CERT: a follower of an HTTPS origin whose certificate that CA signed gets its
    versions; with another CA it gets nothing, says why, and its tensors stay as they were."""
    job, other = pki.authority("job"), pki.authority("another")
    served = pki.serving(job, ["127.0.0.1"])
    for name, data in (
        ("job.crt", job.cert),
        ("other.crt", other.cert),
        ("tls.crt", served.cert),
        ("tls.key", served.key),
    ):
        (tmp_path / name).write_bytes(data)
    w = weights()
    pub = Publisher(w, tmp_path / "store", base_every=2)
    origin = pub.serve(TOKEN, tls_cert=tmp_path / "tls.crt", tls_key=tmp_path / "tls.key")
    assert origin.url.startswith("https://")
    step(w)
    pub.publish()
    try:
        for ca, gets in (("job.crt", True), ("other.crt", False)):
            monkeypatch.setenv(CA_ENV, str(tmp_path / ca))
            held = bf16(weights())
            before = {n: t.clone() for n, t in held.items()}
            f = _Follower(Subscriber([origin.url], held, held=0, token=TOKEN, attempts=2, ssl_context=trusting_env()))
            try:
                if gets:
                    update(f, 1)
                    assert state_hash(held) == pub.state_hash
                else:
                    until(lambda: f.failure, 60, "the fetch refused")
                    assert "certificate" in f.failure and all(torch.equal(held[n], before[n]) for n in held)
            finally:
                f.stop()
        monkeypatch.setenv(CA_ENV, str(tmp_path / "missing.crt"))
        with pytest.raises(ValueError, match="SPARROWRL_CA_CERT .*missing.crt"):
            trusting_env()
    finally:
        origin.close()
