"""An environment's tools (verifiers' ToolEnv: plain Python functions): the calls a model turn
makes, read from its text, and each call run in a process of its own, forked from the
environment's, behind the walls of sandbox.py, in a fresh folder that is removed after it.

A call the model got wrong (an unknown tool, arguments that are not JSON or do not fit), or a
tool that raises, answers with an error message, as verifiers' ToolEnv does, and the episode goes
on: the model sees its mistake. A tool that outlives its time, or whose process dies (killed at
its memory or CPU limit, or crashed), ends the episode (`ToolFailure`). Output beyond its limit is
cut, and says so."""

from __future__ import annotations

import ctypes
import faulthandler
import inspect
import json
import os
import resource
import select
import shutil
import signal
import tempfile
import time
from typing import Any, Callable

from sparrowrl.agents.sandbox import Limits, confine

OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes' format: Qwen's and most chat models'
Call = tuple[str, Any]  # a tool's name and its arguments (a dict, when well-formed)


class ToolFailure(Exception):
    """A tool that hung or whose process died: the end of its episode."""


def hermes(text: str) -> list[Call]:
    """The calls in a model turn's text: each <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
    A call that does not parse comes back as ("", why), for the model to be told. One pass over
    the text: a turn of many openings and no close costs no more than its length."""
    calls: list[Call] = []
    at = 0
    while (start := text.find(OPEN, at)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        body, at = text[start + len(OPEN) : end].strip(), end + len(CLOSE)
        try:
            call = json.loads(body)
        except ValueError as e:
            calls.append(("", f"the tool call is not JSON ({e})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(("", 'the tool call is not {"name": ..., "arguments": {...}}'))
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError as e:
                calls.append(("", f"the arguments of {call['name']} are not JSON ({e})"))
                continue
        calls.append((call["name"], args))
    return calls


def run(
    tools: dict[str, Callable[..., Any]], call: Call, limits: Limits, output: int, root: str | None = None
) -> tuple[bool, str]:
    """One call: (whether it succeeded, the tool message's text), its folder made under `root`.
    ToolFailure: it hung or died."""
    name, args = call
    if not name:
        return False, f"Error: {args}"
    fn = tools.get(name)
    if fn is None:
        return False, f"Error: no tool {name!r} (the tools are {', '.join(sorted(tools))})"
    if not isinstance(args, dict):
        return False, f"Error: the arguments of {name} are not an object"
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as e:
        return False, f"Error: {name}{inspect.signature(fn)} cannot take {json.dumps(args)[:200]}: {e}"
    except ValueError:  # no signature to read: the call will tell
        pass
    folder = tempfile.mkdtemp(prefix="sparrowrl-tool-", dir=root)
    try:
        return _forked(fn, args, folder, limits, output, name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _forked(
    fn: Callable[..., Any], args: dict, folder: str, limits: Limits, output: int, name: str
) -> tuple[bool, str]:
    read, write = os.pipe()
    me = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(read)
        os.close(write)
        raise
    if pid == 0:  # the tool's process: nothing here returns
        _child(fn, args, folder, limits, write, me)
    os.close(write)
    done = os.pidfd_open(pid)  # readable once the process has exited: its end, waited for with its answer
    data, deadline = bytearray(), time.monotonic() + limits.seconds
    most = 4 * output + 8  # bytes: any `output` characters of UTF-8, the tag and the end mark
    try:
        eof = False
        while True:
            left = deadline - time.monotonic()
            ready = select.select([done] if eof else [read, done], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise ToolFailure(f"tool {name} took longer than {limits.seconds:g} s")
            if read in ready and not eof:
                chunk = os.read(read, 65536)
                eof = not chunk
                if len(data) < most:
                    data += chunk[: most - len(data)]
                continue
            if done in ready:
                break
    finally:
        os.close(read)
        os.close(done)
    _, status = os.waitpid(pid, 0)
    if not data or (os.WIFSIGNALED(status) and not data.endswith(b"\n\0")):
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit code {os.WEXITSTATUS(status)}"
        raise ToolFailure(f"tool {name}'s process died ({how}) before it answered")
    ok, text = data[:1] == b"o", data[1:].removesuffix(b"\n\0").decode(errors="replace")
    cut = len(text) > output
    return ok, text[:output] + (f"\n[output cut at {output} characters]" if cut else "")


def _child(fn: Callable[..., Any], args: dict, folder: str, limits: Limits, out: int, parent: int) -> None:
    code = 0
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1: PR_SET_PDEATHSIG
            os._exit(71)
        if os.getppid() != parent:  # the environment's process died before the line above
            os._exit(71)
        faulthandler.disable()  # a tool that crashes is reported by its signal, not with the worker's tracebacks
        os.dup2(out, 3)  # its answer's pipe, and nothing else of the worker's: no other descriptor stays open
        os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        os.chdir(folder)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # what a tool prints is not its answer
            os.dup2(null, fd)
        os.close(null)
        confine(folder, limits)
        try:
            result = fn(**args)
            if inspect.isawaitable(result):  # an async tool (verifiers' may be)
                result = _awaited(result)
            answer = b"o" + (result if isinstance(result, str) else json.dumps(result, default=str)).encode()
        except BaseException as e:  # the tool's own error: the model is told
            answer = b"e" + f"Error: {type(e).__name__}: {e}".encode()
        view = memoryview(answer + b"\n\0")
        while view:
            view = view[os.write(3, view) :]
    except BaseException:
        code = 70  # EX_SOFTWARE: the walls could not be raised, or the answer not sent
    os._exit(code)


def _awaited(result: Any) -> Any:
    """A coroutine run to its end, on a thread of its own: this process was forked from one whose
    event loop may be running, and a loop is one per thread."""
    import asyncio
    import threading

    out: list[tuple[bool, Any]] = []

    async def wait() -> Any:
        return await result

    def run() -> None:
        try:
            out.append((True, asyncio.run(wait())))
        except BaseException as e:
            out.append((False, e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value
