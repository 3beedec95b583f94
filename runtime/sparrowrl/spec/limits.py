"""Bounds on what a user or a peer can make this code read. docs/limits.md lists every bound
and what a user sees when one is hit."""

from __future__ import annotations

import os
import resource
import stat
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

MAX_JOB_BYTES = 1 << 20  # a Kubernetes object is at most ~1.5 MiB in etcd
MAX_YAML_NODES = 100_000  # YAML values after alias expansion: a real job has a few hundred
MAX_TASK_BYTES = 256 << 20  # a JSONL task file is read whole into memory


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup (v2 or v1) lets it grow by, if it has a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            where, limit, usage = Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            where, limit, usage = (
                Path("/sys/fs/cgroup/memory") / path.lstrip("/"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        try:
            cap, used = (where / limit).read_text().strip(), int((where / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # v1 says "no limit" with a huge number, v2 with "max"
            return max(0, int(cap) - used)
    return None


def _proc_bytes(path: str, key: str) -> int | None:
    """A `Key:   N kB` line of a /proc file, in bytes; None where there is none."""
    try:
        lines = Path(path).read_text().splitlines()
        return next(int(line.split()[1]) << 10 for line in lines if line.startswith(f"{key}:"))
    except (OSError, StopIteration, ValueError):
        return None


def _address_space_room() -> int | None:
    """Bytes this process's address space may still grow by, under `ulimit -v`."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    used = _proc_bytes("/proc/self/status", "VmSize")
    return None if soft == resource.RLIM_INFINITY or used is None else max(0, soft - used)


def memory_available() -> int:
    """Bytes of memory this process can take now: the kernel's MemAvailable, less where its
    cgroup (a container's limit) or `ulimit -v` allow less. A file read whole must fit in it."""
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(x for x in (available, _cgroup_room(), _address_space_room()) if x is not None)


def open_regular(path: str | Path, what: str) -> BinaryIO:
    """`path` opened for reading, or ValueError if it is not a regular file: the open itself
    does not block on a FIFO, and a device or a FIFO would otherwise be read forever."""
    try:
        f = os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise ValueError(f"{path}: {what} must be a regular file")
    return f


def read_bounded(path: str | Path, limit: int, what: str) -> bytes:
    """A regular file's bytes, refused before reading if it is larger than `limit`.
    ValueError names the problem."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise ValueError(f"{path}: {what} is {size:,} bytes (limit {limit:,})")
        try:
            data = f.read(size + 1)  # read(n) allocates n bytes up front
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror}") from None
    if len(data) > size:
        raise ValueError(f"{path}: {what} grew while being read")
    return data


def first_problem(e: ValidationError) -> str:
    """pydantic's first error as one line: `field.path: reason`."""
    err = e.errors()[0]
    where, msg = ".".join(map(str, err["loc"])), err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg
