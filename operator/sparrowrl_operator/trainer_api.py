"""The trainer's API as the operator reads it: GET /v1/status at the running pod's IP (the
operator may sit outside cluster DNS). An encrypted job's trainer is checked as its workers check
it: a certificate the job's CA signed, for the name of the trainer's Service."""

from __future__ import annotations

import http.client
import ssl

from pydantic import ValidationError

from sparrowrl.spec.status import TrainerStatus
from sparrowrl_operator.constants import ROLE_LABEL, TRAINER_PORT
from sparrowrl_operator.pods import other_node

MAX_STATUS_BYTES = 16 << 20
TIMEOUT = 5.0


class _Named(http.client.HTTPSConnection):
    """HTTPS to an address, checking the certificate against a name (its Service's) instead."""

    def __init__(self, host: str, port: int, name: str, context: ssl.SSLContext):
        super().__init__(host, port, timeout=TIMEOUT, context=context)
        self._name = name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._name)  # type: ignore[attr-defined]


def serves_tls(pod: dict) -> bool:
    """Whether a trainer pod serves HTTPS: as it was made, whatever the job says now."""
    return any("--tls-cert" in (c.get("args") or []) for c in (pod.get("spec") or {}).get("containers") or [])


def trusting(ca: bytes) -> ssl.SSLContext | None:
    """A context that trusts `ca` alone (an intermediate too), or None when it holds no CA."""
    try:
        context = ssl.create_default_context(cadata=ca.decode("ascii"))
    except (ssl.SSLError, ValueError):  # not PEM: the Encrypted condition says why
        return None
    if not context.get_ca_certs():
        return None
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context


def trainer_status(pods: list[dict], token: str, ca: bytes | None, name: str) -> TrainerStatus | None:
    """The status of the running trainer pod, or None when none answers. A pod that serves HTTPS
    is asked over HTTPS alone, checked against `ca` (the job's) for `name` (the trainer Service's):
    without a CA that loads, it is not asked, since the request carries the job's secret."""
    for p in pods:
        st = p.get("status") or {}
        if p["metadata"]["labels"].get(ROLE_LABEL) != "trainer" or st.get("phase") != "Running" or not st.get("podIP"):
            continue
        if other_node(p):  # a trainer's node 1..: no API there, and it must not be sent the job's token
            continue
        if serves_tls(p):
            context = trusting(ca) if ca else None
            if context is None:
                continue
            conn: http.client.HTTPConnection = _Named(st["podIP"], TRAINER_PORT, name, context)
        else:
            conn = http.client.HTTPConnection(st["podIP"], TRAINER_PORT, timeout=TIMEOUT)
        try:
            conn.request("GET", "/v1/status", headers={"Authorization": f"Bearer {token}"})
            r = conn.getresponse()
            if r.status != 200:
                continue
            return TrainerStatus.model_validate_json(r.read(MAX_STATUS_BYTES))
        except (OSError, http.client.HTTPException, ValidationError):
            continue
        finally:
            conn.close()
    return None
