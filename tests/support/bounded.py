"""Abuse cases run the code under test in a child process with an address-space limit and a
deadline: a regression that eats memory or hangs fails its test instead of taking the machine
down with it."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch  # noqa: F401  (BASELINE: the address space of a process with torch loaded)

from support.wait import listening, until

EXE = Path(sys.executable).parent / "sparrowrl"
MEMORY = 2 << 30  # bytes a case may take beyond what the code under test needs to start
TOKEN = "t0ken-for-abuse"


def vm_size() -> int:
    """This process's address space now, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))


BASELINE = vm_size()  # with torch loaded, as the CLI has it


def limit_memory() -> None:
    """In a child before exec: the address space of a test process that has imported torch (as
    the CLI does; a CUDA build maps much more than a CPU one), plus MEMORY."""
    resource.setrlimit(resource.RLIMIT_AS, (BASELINE + MEMORY, BASELINE + MEMORY))


def sparrowrl(
    *args, timeout: float = 120, env: dict | None = None, cwd=None, input: str | None = None
) -> subprocess.CompletedProcess:
    """The CLI as a bounded child; a run past `timeout` fails the test (TimeoutExpired)."""
    return subprocess.run(
        [str(EXE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        input=input,
        env=dict(os.environ, **(env or {})),
        preexec_fn=limit_memory,
    )


# one child for several commands: typer's runner in it, each command's exit code and output
# (with the traceback of an error the command let through, as a process would print it)
EACH = """
import json, sys, traceback
from typer.testing import CliRunner
from sparrowrl.cli.main import app
done = []
for args in json.loads(sys.argv[1]):
    r = CliRunner().invoke(app, args)
    crash = "" if r.exception is None or isinstance(r.exception, SystemExit) else "".join(
        traceback.format_exception(*r.exc_info))
    done.append([r.exit_code, r.stdout, r.stderr + crash])
print(json.dumps(done))
"""


def sparrowrl_each(*commands, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Each of `commands` (the CLI's arguments) run one after another in one bounded child: a
    start of the CLI imports torch again (seconds), and a case of several commands needs it once."""
    argvs = [[str(a) for a in c] for c in commands]
    p = subprocess.run(
        [sys.executable, "-P", "-c", EACH, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit_memory,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [
        subprocess.CompletedProcess(a, code, out, err)
        for a, (code, out, err) in zip(argvs, json.loads(p.stdout.splitlines()[-1]))
    ]


def refused(p: subprocess.CompletedProcess, *words: str) -> str:
    """A one-line error naming the problem: exit 1, no traceback, every word in the message."""
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)
    return p.stderr.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(*args, token: str = TOKEN):
    """`sparrowrl ARGS --port P` (serve or relay) as a bounded child; yields (process, port)."""
    port = free_port()
    p = subprocess.Popen(
        [str(EXE), *map(str, args), "--port", str(port)],
        env=dict(os.environ, SPARROWRL_TOKEN=token),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit_memory,
    )
    try:
        until(lambda: listening(port), 60, f"sparrowrl {args[0]} on port {port}", every=0.1, alive={args[0]: p})
        yield p, port
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextmanager
def address_space(extra: int = MEMORY):
    """For abuse cases that run in the test's own process: it may grow by `extra` bytes at most
    meanwhile (the soft limit, restored after), so a regression fails with MemoryError."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
