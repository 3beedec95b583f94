"""The walls of a tool call's process, raised in the child before the tool runs: it may write only
in its own folder (Landlock), it may not start processes (seccomp: fork, vfork and clone without
CLONE_THREAD fail; threads still start), and rlimits bound its memory (beyond what the process
had mapped when it forked), CPU time, file sizes and open files. Linux only, with no privileges
needed: Landlock and seccomp are what an unprivileged process can do to itself, once it has given
up gaining privileges (no_new_privs).

Where the kernel has no Landlock (before 5.13, or not enabled), writes are bounded by RLIMIT_FSIZE
only; `confine` says which walls stand, and the environment's process logs it once."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import struct
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)

# Landlock (linux/landlock.h): the rights that change the filesystem, handled (so denied) except
# beneath the tool's folder; reading and executing are left alone (Python imports its modules).
_LANDLOCK = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_PATH_BENEATH = 1

# seccomp (linux/seccomp.h, linux/filter.h): process-creating syscalls refused
_SECCOMP = {  # arch: (AUDIT_ARCH, clone, clone3, fork and vfork if it has them, the x32 ABI's bit)
    "x86_64": (0xC000003E, 56, 435, (57, 58), 0x40000000),
    "aarch64": (0xC00000B7, 220, 435, (), None),
}
_CLONE_THREAD = 0x10000
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_EPERM, _ENOSYS = 1, 38


FILES = 256  # open file descriptors


@dataclass(frozen=True)
class Limits:
    seconds: float  # wall time; CPU time is bounded just above it
    memory: int  # bytes of address space
    files: int = 64 << 20  # bytes of any file it writes


def confine(folder: str, limits: Limits) -> list[str]:
    """In the tool's child process: the walls up, in that order. Returns the walls that could not
    be raised (the kernel lacks them). Raises OSError where one that should stand does not."""
    missing = []
    with open("/proc/self/statm") as f:  # its first field: the address space mapped now, in pages
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + limits.memory, mapped + limits.memory))
    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))
    cpu = int(limits.seconds) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.files, limits.files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if _libc.prctl(38, 1, 0, 0, 0) != 0:  # 38: PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if not _landlock(folder):
        missing.append("landlock")
    if not _no_processes():
        missing.append("seccomp")
    return missing


def _landlock(folder: str) -> bool:
    calls = _LANDLOCK.get(platform.machine())
    if calls is None:
        return False
    create, add, restrict = calls
    abi = _libc.syscall(create, None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # 1: the ABI version
    if abi < 1:
        return False
    handled = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    handled |= _REFER if abi >= 2 else 0
    handled |= _TRUNCATE if abi >= 3 else 0
    attr = struct.pack("=Q", handled)  # struct landlock_ruleset_attr, its first field (ABI 1's size)
    ruleset = _libc.syscall(create, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in ((folder, handled), ("/dev/null", _WRITE_FILE | (_TRUNCATE if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr (packed)
                if _libc.syscall(add, ruleset, _PATH_BENEATH, ctypes.c_char_p(rule), ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        if _libc.syscall(restrict, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return True


def _no_processes() -> bool:
    arch = _SECCOMP.get(platform.machine())
    if arch is None:
        return False
    audit, clone, clone3, forks, x32 = arch

    def op(code: int, jt: int, jf: int, k: int) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter

    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|{JEQ,JGE,JSET}|K, BPF_RET|K
    prog = [
        op(ld, 0, 0, 4),  # seccomp_data.arch
        op(jeq, 1, 0, audit),
        op(ret, 0, 0, _KILL),
        op(ld, 0, 0, 0),  # seccomp_data.nr
    ]
    if x32 is not None:  # x32's numbers (the same calls, this bit set) are refused whole
        prog += [op(jge, 0, 1, x32), op(ret, 0, 0, _ERRNO | _EPERM)]
    prog += [
        op(jeq, 0, 1, clone3),
        op(ret, 0, 0, _ERRNO | _ENOSYS),  # the C library falls back to clone, whose flags can be read
    ]
    for nr in forks:
        prog += [op(jeq, 0, 1, nr), op(ret, 0, 0, _ERRNO | _EPERM)]
    prog += [
        op(jeq, 1, 0, clone),
        op(ret, 0, 0, _ALLOW),
        op(ld, 0, 0, 16),  # seccomp_data.args[0], its low word: clone's flags
        op(jset, 0, 1, _CLONE_THREAD),
        op(ret, 0, 0, _ALLOW),  # a thread
        op(ret, 0, 0, _ERRNO | _EPERM),  # a process
    ]
    code = b"".join(prog)
    buf = ctypes.create_string_buffer(code)
    fprog = struct.pack("HP", len(prog), ctypes.addressof(buf))  # struct sock_fprog (native: padded)
    if _libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return True


def available() -> list[str]:
    """The walls this kernel and machine can raise (without raising them)."""
    walls = []
    calls = _LANDLOCK.get(platform.machine())
    if calls is not None and _libc.syscall(calls[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1:
        walls.append("landlock")
    if platform.machine() in _SECCOMP:
        walls.append("seccomp")
    return walls
