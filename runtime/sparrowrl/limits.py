"""Bounds on what a user or a peer can make this code read. docs/limits.md lists every bound
and what a user sees when one is hit."""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_JOB_BYTES = 1 << 20  # a Kubernetes object is at most ~1.5 MiB in etcd
MAX_YAML_NODES = 100_000  # YAML values after alias expansion: a real job has a few hundred
MAX_TASK_BYTES = 256 << 20  # a JSONL task file is read whole into memory


def memory_available() -> int:
    """Bytes of memory free now: a file read whole must fit in it."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """A regular file's bytes, refused before reading if it is larger than `limit`: a device or
    a FIFO given as a file would otherwise be read forever. ValueError names the problem."""
    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:  # a FIFO's open would block
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path}: {what} must be a regular file")
            if st.st_size > limit:
                raise ValueError(f"{path}: {what} is {st.st_size:,} bytes (limit {limit:,})")
            data = f.read(st.st_size + 1)  # read(n) allocates n bytes up front
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if len(data) > st.st_size:
        raise ValueError(f"{path}: {what} grew while being read")
    return data
