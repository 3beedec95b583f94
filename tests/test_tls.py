"""TLS on a role's listener: a job's own CA (auth/pki.py) signs its serving certificate; a client
that trusts the CA gets through, one that trusts another refuses the server, plain HTTP is
refused; a certificate replaced on disk serves the next connection with no restart, and one that
does not load leaves the last good one serving. Real TLS over loopback."""

import asyncio
import logging
import os
import ssl

import aiohttp
import pytest
from aiohttp import web
from support.servers import free_port

from sparrowrl.auth import pki
from sparrowrl.transport.http import ServingTLS, TrustedCA, add_health, listen, tls

pytestmark = pytest.mark.timeout(60)


def write(folder, issued, name):
    """A certificate and key written as a Secret's volume swaps them: whole files, renamed in."""
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    for path, data in ((cert, issued.cert), (key, issued.key)):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return cert, key


def trusting(ca):
    return ssl.create_default_context(cadata=ca.cert.decode())


async def get(port, ctx, scheme="https"):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, force_close=True)) as s:
        async with s.get(f"{scheme}://127.0.0.1:{port}/healthz") as r:
            return r.status


async def serving(served):
    app = web.Application()
    add_health(app, lambda: True)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await listen(runner, "127.0.0.1", port, served)
    return runner, port


def test_a_job_s_ca_signs_what_its_clients_trust_and_nothing_else_gets_through(tmp_path):
    """Only the job's CA, and only for the name the client asked for."""
    job, other = pki.authority("job-a"), pki.authority("job-b")
    cert, key = write(tmp_path, pki.serving(job, ["127.0.0.1", "trainer.default.svc"]), "serving")

    async def main():
        runner, port = await serving(tls(cert, key))
        try:
            assert await get(port, trusting(job)) == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await get(port, trusting(other))
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port: no answer
                await get(port, None, "http")
        finally:
            await runner.cleanup()
        # the job's CA signed it, for another name (a relay's, say): refused at 127.0.0.1 all the same
        elsewhere = write(tmp_path, pki.serving(job, ["relay-eu.sparrowrl.svc"]), "elsewhere")
        runner, port = await serving(tls(*elsewhere))
        try:
            with pytest.raises(aiohttp.ClientConnectorCertificateError, match="match|mismatch"):
                await get(port, trusting(job))
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_certificate_replaced_on_disk_serves_the_next_connection_without_a_restart(tmp_path, caplog):
    first, second = pki.authority("before"), pki.authority("after")
    cert, key = write(tmp_path, pki.serving(first, ["127.0.0.1"]), "serving")
    served = ServingTLS(cert, key)

    async def main():
        runner, port = await serving(served)
        try:
            assert await get(port, trusting(first)) == 200
            write(tmp_path, pki.serving(second, ["127.0.0.1"]), "serving")  # renewed, by another CA to tell
            assert await get(port, trusting(second)) == 200
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await get(port, trusting(first))
            (tmp_path / "serving.crt").write_bytes(b"half a renewal")
            with caplog.at_level(logging.ERROR):
                assert await get(port, trusting(second)) == 200  # the last good one goes on
            assert "are not a PEM certificate and its private key" in caplog.text
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_a_ca_rotated_in_its_file_is_trusted_by_a_running_client_from_the_next_connection(tmp_path, caplog):
    """A client's CA file (a Secret's volume) replaced: the same client, with no restart, trusts
    the new CA from its next connection (and the old one still); one that does not load changes
    nothing, and says so."""
    from sparrowrl.transport.client import Client
    from sparrowrl.transport.failover import FetchError

    first, second = pki.authority("before"), pki.authority("after")
    cert, key = write(tmp_path, pki.serving(first, ["127.0.0.1"]), "serving")
    ca = tmp_path / "ca.crt"
    ca.write_bytes(first.cert)
    served = tls(cert, key)

    async def main():
        app = web.Application()

        async def answer(_request: web.Request) -> web.Response:
            # each answer closes its connection: the next request makes its handshake anew
            return web.json_response({"ok": True}, headers={"Connection": "close"})

        app.add_routes([web.get("/x", answer)])
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await listen(runner, "127.0.0.1", port, served)
        url = f"https://127.0.0.1:{port}"
        try:
            async with Client(url, token="", trust=None, attempts=1, ssl_context=TrustedCA.of(ca)) as c:
                assert await c.json("/x") == {"ok": True}
                write(tmp_path, pki.serving(second, ["127.0.0.1"]), "serving")  # the server renewed by the new CA
                with pytest.raises(FetchError, match="certificate not trusted"):
                    await c.json("/x")
                c.servers.server, c.servers._refused = 0, {}  # asked again at once, as after its backoff
                ca.write_bytes(b"half written")
                with caplog.at_level(logging.ERROR), pytest.raises(FetchError):
                    await c.json("/x")
                assert "does not load" in caplog.text
                c.servers._refused = {}
                tmp = ca.with_suffix(".new")
                tmp.write_bytes(second.cert)
                os.replace(tmp, ca)  # the new CA, as a Secret's volume updates it
                assert await c.json("/x") == {"ok": True}
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_serving_flags_are_both_or_neither_and_name_the_file(tmp_path):
    cert, key = write(tmp_path, pki.serving(pki.authority("job"), ["127.0.0.1"]), "serving")
    assert tls(None, None) is None
    with pytest.raises(ValueError, match="TLS needs both --tls-cert and --tls-key"):
        tls(cert, None)
    with pytest.raises(ValueError, match=f"--tls-cert {tmp_path / 'missing'}: No such file"):
        tls(tmp_path / "missing", key)
    with pytest.raises(ValueError, match="at least one name"):
        pki.serving(pki.authority("job"), [])


def test_the_sync_api_serves_and_pulls_over_https_and_refuses_another_ca(tmp_path):
    """Publisher.serve with a certificate, Subscriber with the job's CA: a version arrives bit-exact;
    with another CA the pull fails, and the tensors stay as they were."""
    import torch
    from support.tensors import bf16

    from sparrowrl.delta import state_hash
    from sparrowrl.sync import FetchError, Origin, Publisher, Subscriber
    from sparrowrl.trainer import models

    job, other = pki.authority("job"), pki.authority("other")
    cert, key = write(tmp_path, pki.serving(job, ["127.0.0.1"]), "origin")
    model = models.tiny_qwen3(64, 32, 2, 2, seed=0)
    held = bf16(model)
    pub = Publisher(dict(model.named_parameters()), tmp_path / "store")
    with pub.serve("a secret", tls_cert=cert, tls_key=key) as origin:
        assert origin.url.startswith("https://127.0.0.1:")
        with torch.no_grad():
            next(model.parameters()).add_(0.5)  # a step
        assert pub.publish() == 1

        async def pull(ctx, servers=None):
            async with Subscriber(
                servers or origin.url,
                held,
                held=0,
                token="a secret",
                trainer_key=origin.trainer_key,
                ssl_context=ctx,
                attempts=1,
            ) as sub:
                await sub.pull(1)

        before = state_hash(held)
        with pytest.raises(FetchError, match="certificate not trusted"):
            asyncio.run(pull(trusting(other)))
        assert state_hash(held) == before
        # a server whose certificate another CA signed is passed over for the next one
        bad_cert, bad_key = write(tmp_path, pki.serving(other, ["127.0.0.1"]), "impostor")
        with Origin(pub.store.path, "a secret", tls_cert=bad_cert, tls_key=bad_key) as impostor:
            asyncio.run(pull(trusting(job), [impostor.url, origin.url]))
        assert state_hash(held) == pub.store.versions[1].state_hash != before


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_local_run_with_tls_trains_over_https_and_another_ca_is_refused(tmp_path):
    """`sparrowrl run --tls`: every hop HTTPS under the run's own CA, every commit verified. Then
    the trainer of that job on its own over TLS, and a worker that trusts another CA: it refuses
    the trainer at once, with the reason, and never falls back to plain HTTP."""
    import json
    import subprocess
    import urllib.request

    import yaml
    from support import jobs
    from support.servers import EXE
    from support.wait import until

    from sparrowrl.auth import tokens

    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(jobs.job(steps=2, grpo=jobs.GRPO, topology=jobs.TWO_REGIONS)))
    out = tmp_path / "run"
    p = subprocess.run([EXE, "run", f, "--run-dir", out, "--tls"], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["weights_mismatch"] == 0 and s["weights_verified"] >= 2 * 2, s
    urls = json.loads((out / "processes.json").read_text())["urls"]
    assert len(urls) == 4 and all(u.startswith("https://127.0.0.1:") for u in urls.values()), urls
    assert "trainer: serving on https://" in (out / "logs" / "trainer.log").read_text()
    assert all((out / "tls" / n).stat().st_mode & 0o077 == 0 for n in ("ca.crt", "serving.crt", "serving.key"))

    port, secret = free_port(), "the job's secret"
    metrics = free_port()
    trainer = subprocess.Popen(
        [EXE, "trainer", f, "--state-dir", tmp_path / "state", "--port", str(port), "--metrics-port", str(metrics)]
        + ["--tls-cert", out / "tls" / "serving.crt", "--tls-key", out / "tls" / "serving.key"],
        env={**os.environ, **tokens.environment(secret, "trainer", "trainer")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        ctx = ssl.create_default_context(cafile=str(out / "tls" / "ca.crt"))

        def up() -> bool:
            try:
                return urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=5, context=ctx).status == 200
            except OSError:
                return False

        until(up, 120, "the trainer over HTTPS", every=0.2, alive={"trainer": trainer})

        def scraped() -> bytes | None:  # its open metrics port, once the job is loaded: HTTPS too
            try:
                return urllib.request.urlopen(f"https://127.0.0.1:{metrics}/metrics", timeout=5, context=ctx).read()
            except OSError:
                return None

        assert b"sparrowrl_" in until(
            scraped, 120, "the metrics port over HTTPS", every=0.2, alive={"trainer": trainer}
        )
        with pytest.raises(OSError):  # plain HTTP to it gets no answer
            urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5)
        other = tmp_path / "other.crt"
        other.write_bytes(pki.authority("another job").cert)
        w = subprocess.run(
            [EXE, "worker", "--trainer", f"https://127.0.0.1:{port}", "--name", "w0", "--port", str(free_port())]
            + ["--ca-cert", other],
            env={**os.environ, **tokens.environment(secret, "worker", "w0")},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert w.returncode == 1 and "certificate not trusted" in w.stderr, w.stderr[-2000:]
    finally:
        trainer.kill()
        trainer.wait()
