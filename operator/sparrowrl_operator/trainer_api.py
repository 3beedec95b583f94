"""The trainer's API as the operator reads it: GET /v1/status at the running pod's IP (the
operator may sit outside cluster DNS). An encrypted job's trainer is checked as its workers check
it: a certificate the job's CA signed, for the name of the trainer's Service."""

from __future__ import annotations

import http.client
import ssl

from pydantic import ValidationError

from sparrowrl.spec.status import TrainerStatus
from sparrowrl_operator.constants import ROLE_LABEL, TRAINER_PORT

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


def trainer_status(pods: list[dict], token: str, ca: bytes | None, name: str) -> TrainerStatus | None:
    """The status of the running trainer pod, or None when none answers. `ca`: the job's CA (an
    encrypted job), `name`: the trainer Service's name its certificate is for."""
    try:
        context = ssl.create_default_context(cadata=ca.decode(errors="replace")) if ca is not None else None
    except (ssl.SSLError, ValueError):  # a CA that does not load: the Encrypted condition says why
        return None
    for p in pods:
        st = p.get("status") or {}
        if p["metadata"]["labels"].get(ROLE_LABEL) != "trainer" or st.get("phase") != "Running" or not st.get("podIP"):
            continue
        conn = (
            _Named(st["podIP"], TRAINER_PORT, name, context)
            if context
            else http.client.HTTPConnection(st["podIP"], TRAINER_PORT, timeout=TIMEOUT)
        )
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
