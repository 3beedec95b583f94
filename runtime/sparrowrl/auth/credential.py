"""A process's token: SPARROWRL_TOKEN, or the file SPARROWRL_TOKEN_FILE names (a Secret's volume
in a pod). The file is read again when it changes, so a role token the operator refreshes
before it expires serves the next request, with no restart: each use stats the file (no
polling), as a role's TLS certificate is."""

from __future__ import annotations

import logging
import os
from pathlib import Path

TOKEN_ENV = "SPARROWRL_TOKEN"
FILE_ENV = "SPARROWRL_TOKEN_FILE"
MAX_BYTES = 4096  # a role token is a few hundred bytes; the job's secret, 32
log = logging.getLogger(__name__)


class Credential:
    """A token given once (`value`), or kept in a file (`path`) and read again when it changes."""

    def __init__(self, value: str = "", path: Path | None = None):
        self.path, self._value, self._seen = path, value, None
        self._failed = False
        if path is not None:
            self._seen = self._stat_or_none()
            self._value = self._read()

    @classmethod
    def from_env(cls) -> Credential:
        """SPARROWRL_TOKEN, or SPARROWRL_TOKEN_FILE's. ValueError: both set, or the file unreadable."""
        value, file = os.environ.get(TOKEN_ENV, ""), os.environ.get(FILE_ENV, "")
        if value and file:
            raise ValueError(f"set {TOKEN_ENV} or {FILE_ENV}, not both")
        return cls(path=Path(file)) if file else cls(value)

    @classmethod
    def of(cls, token: str | Credential | None) -> Credential:
        """A token given, a Credential as it is, or (None) the environment's."""
        if isinstance(token, Credential):
            return token
        return cls.from_env() if token is None else cls(token)

    def get(self) -> str:
        """The token as it is now: a changed file is read again; one that cannot be read (half
        written, gone) leaves the last good token in use, logged once."""
        if self.path is None:
            return self._value
        seen = self._stat_or_none()
        if seen is not None and seen != self._seen:
            try:
                self._value, self._seen, self._failed = self._read(), seen, False
                log.info(f"token: read {self.path} again (it changed)")
            except ValueError as e:
                if not self._failed:
                    log.error(f"{e}; the token read before stays in use")
                self._failed = True
        return self._value

    def _stat(self) -> tuple[int, ...]:
        assert self.path is not None
        s = os.stat(self.path)  # through the links of a Secret's volume: ..data switched is a new file
        return (s.st_dev, s.st_ino, s.st_mtime_ns, s.st_ctime_ns, s.st_size)

    def _stat_or_none(self) -> tuple[int, ...] | None:
        try:
            return self._stat()
        except OSError:
            return None

    def _read(self) -> str:
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{FILE_ENV} {self.path}: {e.strerror or e}") from None
        text = data.decode(errors="replace").strip()
        if len(data) > MAX_BYTES or not text or not text.isprintable():
            raise ValueError(f"{FILE_ENV} {self.path}: not a token (empty, over {MAX_BYTES} bytes, or not text)")
        return text
