"""How the operator reads a trainer's /v1/status (trainer_api.py): over HTTPS when the pod serves
it, checked against the job's CA for the Service's name, never in plain HTTP to such a pod (the
request carries the job's secret), and in plain HTTP only to a pod made without TLS. Real
servers on a loopback address of their own, at the trainer's port."""

from __future__ import annotations

import http.server
import ssl
import threading
from contextlib import contextmanager

from test_operator_decisions import trainer_status

from sparrowrl.auth import pki
from sparrowrl_operator.constants import ROLE_LABEL, TRAINER_PORT
from sparrowrl_operator.trainer_api import trainer_status as read_status

NAME = "grpo-trainer.default.svc"
STATUS = trainer_status([("w", 1.0, "ok")]).model_dump_json().encode()


@contextmanager
def trainer(served: pki.Issued | None, tmp_path, ip: str):
    """A trainer's /v1/status at ip:TRAINER_PORT, HTTPS with `served`; yields the headers it got."""
    seen: list[str] = []

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(STATUS)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((ip, TRAINER_PORT), Status)
    if served is not None:
        (tmp_path / "s.crt").write_bytes(served.cert)
        (tmp_path / "s.key").write_bytes(served.key)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tmp_path / "s.crt", tmp_path / "s.key")
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield seen
    finally:
        server.shutdown()
        server.server_close()


def pod(tls: bool, ip: str) -> dict:
    args = ["trainer", "job.yaml"] + (["--tls-cert", "tls/tls.crt", "--tls-key", "tls/tls.key"] if tls else [])
    return {
        "metadata": {"labels": {ROLE_LABEL: "trainer"}},
        "spec": {"containers": [{"name": "trainer", "args": args}]},
        "status": {"phase": "Running", "podIP": ip},
    }


def test_an_encrypted_trainer_is_read_over_https_checked_against_the_jobs_ca_and_its_name(tmp_path):
    job, other = pki.authority("job"), pki.authority("other")
    ip = "127.83.0.1"  # each test an address of its own: xdist runs them at once
    with trainer(pki.serving(job, [NAME]), tmp_path, ip) as seen:
        assert read_status([pod(True, ip)], "the secret", job.cert, NAME) is not None
        assert seen == ["Bearer the secret"]
        assert read_status([pod(True, ip)], "the secret", other.cert, NAME) is None  # another CA: refused
        assert read_status([pod(True, ip)], "the secret", job.cert, "another.default.svc") is None  # another name
        assert len(seen) == 1  # the handshakes failed: the secret went nowhere


def test_without_a_usable_ca_an_encrypted_trainer_is_not_asked_at_all(tmp_path):
    ip = "127.83.0.2"
    with trainer(None, tmp_path, ip) as seen:  # a plain server where an encrypted trainer should be
        for ca in (None, b"", b"not a certificate"):
            assert read_status([pod(True, ip)], "the secret", ca, NAME) is None
        assert seen == []  # never the job's secret in plain HTTP


def test_a_trainer_made_without_tls_is_read_in_plain_http(tmp_path):
    ip = "127.83.0.3"
    with trainer(None, tmp_path, ip) as seen:
        assert read_status([pod(False, ip)], "the secret", None, NAME) is not None and seen == ["Bearer the secret"]
