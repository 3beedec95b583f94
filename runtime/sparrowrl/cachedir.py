"""Cache folders a process can write. The runtime image installs as root and runs as uid 65532,
which has no passwd entry and so gets `HOME=/` (runtime/Dockerfile): numba's default cache
(beside the package), and `datasets`', CuPy's and matplotlib's (under HOME) cannot be written
there; numba, `datasets` and CuPy fail rather than go without, matplotlib warns. Imports nothing
heavy: the modules that use those libraries call it before they load them."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def writable(path: Path) -> bool:
    """numba's own test of a cache folder: create it, then a file in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def under_home(variable: str, name: str, default: Path) -> None:
    """Point a library's cache `variable` at a folder of this user's own (`own`) where its
    `default` cannot be written, unless the environment names one already."""
    if not os.environ.get(variable) and not writable(default) and (d := own(name)) is not None:
        os.environ[variable] = str(d)


def own(name: str) -> Path | None:
    """A folder for cache `name` in the temporary folder (TMPDIR, else /tmp), this user's alone;
    None where there is no writable temporary folder, or where the folder is another user's or
    others may write it: its files (numba's are pickles) would be loaded as this process's own.
    The temporary folder must be sticky (like /tmp) or writable by this user only, else another
    user could rename this folder away and put their own in its place."""
    uid = os.getuid()
    try:
        parent = Path(tempfile.gettempdir())
        up = parent.stat()
        d = parent / f"sparrowrl-{name}-{uid}"
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError:  # gettempdir raises FileNotFoundError when no temporary folder is writable
        return None
    if up.st_mode & 0o022 and not up.st_mode & stat.S_ISVTX:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o022 or not writable(d):
        return None
    return d
