"""Where a role caches compiled kernels when its install is read-only: a folder of this user's
alone, or none (numba's cache files are pickles, loaded as this process's own code)."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from sparrowrl import cachedir


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_folder_of_this_users_alone_in_a_sticky_temporary_folder(tmp):
    tmp.chmod(0o1777)
    d = cachedir.own("numba")
    assert d == tmp / f"sparrowrl-numba-{os.getuid()}" and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert cachedir.own("numba") == d  # found again


def test_none_where_others_could_swap_it_or_write_in_it(tmp):
    tmp.chmod(0o777)  # others may write, not sticky: they could rename ours away
    assert cachedir.own("numba") is None
    tmp.chmod(0o755)
    d = cachedir.own("numba")
    assert d is not None
    d.chmod(0o777)  # ours, but others may plant files in it
    assert cachedir.own("numba") is None
    d.rmdir()
    (tmp / d.name).symlink_to(tmp)  # not a folder of its own
    assert cachedir.own("numba") is None
