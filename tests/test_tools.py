"""Tools: calls read from a model turn (Hermes' format, or the environment's own), each run in a
process of its own behind its walls (no writes outside its folder, no new processes, bounded
memory, time and output), and what each fault does: the model is told of its own mistakes and a
tool's error; a tool that hangs or dies ends the episode."""

import os
import textwrap

import pytest
from support.wait import until

from sparrowrl.agents import environment, sandbox
from sparrowrl.agents.sandbox import Limits
from sparrowrl.agents.tools import ToolFailure, hermes, run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]  # each call forks a process
LIMITS = Limits(seconds=3.0, memory=256 << 20)


def test_hermes_calls_are_read_and_malformed_ones_named():
    text = (
        'Let me compute.<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = hermes(text)
    assert calls[:2] == [("calc", {"expression": "2*3"}), ("calc", {"expression": "1+1"})]
    assert calls[2][0] == "" and "not JSON" in calls[2][1]
    assert calls[3] == ("", 'the tool call is not {"name": ..., "arguments": {...}}')
    assert hermes("no calls here") == []


def add(a: int, b: int) -> int:
    return a + b


def loud() -> str:
    return "x" * 100_000


def raises() -> str:
    raise KeyError("nothing here")


def sleeps() -> str:
    import time

    time.sleep(60)
    return "late"


def dies() -> str:
    os._exit(9)


def crashes() -> str:
    import ctypes

    return ctypes.string_at(0)  # a segfault


def writes(path: str) -> str:
    with open(path, "w") as f:
        f.write("mine")
    return "written"


def writes_here() -> str:
    with open("scratch.txt", "w") as f:
        f.write("mine")
    return open("scratch.txt").read()


def forks() -> str:
    import subprocess

    return subprocess.run(["echo", "escaped"], capture_output=True, text=True).stdout


def eats() -> str:
    hog = bytearray(1 << 30)  # 1 GiB, beyond its 256 MiB
    return str(len(hog))


TOOLS = {f.__name__: f for f in (add, loud, raises, sleeps, dies, crashes, writes, writes_here, forks, eats)}


def call(name, root=None, **args):
    return run(TOOLS, (name, args), LIMITS, 1000, root)


def test_a_tool_answers_and_its_mistakes_are_the_model_s_to_see():
    assert call("add", a=2, b=3) == (True, "5")
    ok, text = call("loud")
    assert ok and text == "x" * 1000 + "\n[output cut at 1000 characters]"
    assert call("wide") == (True, "é" * 1000 + "\n[output cut at 1000 characters]")  # characters, not bytes
    assert call("raises") == (False, "Error: KeyError: 'nothing here'")
    assert call("nope")[1].startswith("Error: no tool 'nope' (the tools are add, ")
    assert call("add", a=1)[1].startswith('Error: add(a: int, b: int) -> int cannot take {"a": 1}')
    assert run(TOOLS, ("", "the tool call is not JSON"), LIMITS, 1000) == (False, "Error: the tool call is not JSON")


def hides() -> str:
    import time

    os.close(3)  # its answer's pipe: the end of its output, and it lives on
    time.sleep(60)
    return "late"


def peeks(fd: int) -> str:
    os.fstat(fd)
    return "it sees the worker's descriptor"


def wide() -> str:
    return "é" * 5000


TOOLS.update({f.__name__: f for f in (hides, peeks, wide)})


def test_a_tool_that_hangs_or_dies_ends_its_episode():
    with pytest.raises(ToolFailure, match="tool sleeps took longer than 3 s"):
        call("sleeps")
    with pytest.raises(ToolFailure, match="tool hides took longer than 3 s"):
        call("hides")
    with pytest.raises(ToolFailure, match=r"tool dies's process died \(exit code 9\)"):
        call("dies")
    with pytest.raises(ToolFailure, match=r"tool crashes's process died \(signal 11\)"):
        call("crashes")


@pytest.mark.skipif(set(sandbox.available()) != {"landlock", "seccomp"}, reason="this kernel lacks Landlock or seccomp")
def test_a_tool_is_walled_in(tmp_path):
    outside, root = tmp_path / "outside.txt", tmp_path / "tools"
    root.mkdir()
    ok, text = call("writes", root, path=str(outside))
    assert not ok and "Permission denied" in text and not outside.exists()
    assert call("writes_here", root) == (True, "mine")  # its own folder is its to write
    ok, text = call("forks", root)
    assert not ok and "Operation not permitted" in text
    assert call("eats", root) == (False, "Error: MemoryError: ")
    assert not os.listdir(root)  # each call's folder is gone


def test_a_tool_holds_no_descriptor_of_the_worker_s(tmp_path):
    """The environment's process holds the pipe its pool reads answers from (and unpickles): a
    tool forked from it must not be able to write there."""
    with open(tmp_path / "f", "w") as f:
        ok, text = call("peeks", fd=f.fileno())
    assert not ok and "Bad file descriptor" in text, text


def test_a_tool_dies_with_the_environment_s_process(tmp_path):
    """A turn past turnSeconds kills the environment's process: its tool call goes with it."""
    import multiprocessing
    import signal

    def env_process():
        run(TOOLS, ("sleeps", {}), Limits(seconds=60.0, memory=256 << 20), 100, str(tmp_path))

    p = multiprocessing.get_context("fork").Process(target=env_process)
    p.start()
    children = f"/proc/{p.pid}/task/{p.pid}/children"
    [tool] = until(lambda: open(children).read().split(), 10, "the tool's process")
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    until(lambda: not os.path.exists(f"/proc/{tool}"), 10, "the tool's end with the environment's process")


def test_an_environment_s_tools_answer_the_model_s_calls(tmp_path):
    f = tmp_path / "env.py"
    f.write_text(
        textwrap.dedent("""
            def add(a: int, b: int) -> int:
                return a + b

            class Env:
                dataset = [{"prompt": "1+1=", "answer": "2"}]
                tools = [add]
                def reward(self, prompt, completion, answer, **fields):
                    return 0.0

            def load_environment():
                return Env()
        """)
    )
    turn = environment.turn_caller(str(f), {}, environment.ToolLimits(calls=2))
    asked = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    ok, (t, state) = turn(("turn", [{"role": "assistant", "content": asked * 70}], {}, False, 1))
    assert ok == "ok" and not t.done and (t.tool_calls, t.tool_errors) == (70, 68)
    assert [m["content"] for m in t.messages] == [
        "4",
        "4",
        "Error: 68 calls beyond the 2 one turn may make were not run",
    ]  # one message for those beyond: a turn's messages stay within what a worker may send (64)
    assert [m["role"] for m in t.messages] == ["tool"] * 3
    ok, (t, _) = turn(("turn", [{"role": "assistant", "content": "4"}], {}, False, 2))
    assert ok == "ok" and t.done and t.messages == []  # no call, and no env_response: the end, as ToolEnv's
    ok, (t, _) = turn(("turn", [{"role": "assistant", "content": asked}], {}, True, 2))
    assert ok == "ok" and not t.done and t.messages == [] and t.tool_calls == 0  # after the last turn: not run
