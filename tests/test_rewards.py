"""A user's reward in its pool of real worker processes: calls run in parallel, and one that
raises, hangs past its timeout, dies, or returns NaN or a non-number scores 0.0, is counted by
kind, and stops nothing; the pool ends with no process left behind."""

import os

import pytest

from sparrowrl.trainer import rewards

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REWARD = """\
import math, os, pathlib, time

if pathlib.Path(__file__).with_name("broken").exists():
    raise ImportError("this reward cannot load any more")


def judge(prompt, completion, answer, mode="ok", where=None):
    if where:
        pathlib.Path(where, str(os.getpid())).touch()
    if mode == "raise":
        raise RuntimeError("cannot judge " + completion)
    if mode == "hang":
        time.sleep(3600)
    if mode == "exit":
        os._exit(3)
    if mode == "nan":
        return math.nan
    if mode == "none":
        return None
    if mode == "together":  # returns only once `answer` processes are in calls at the same time
        deadline = time.monotonic() + 60
        while len(os.listdir(where)) < int(answer):
            if time.monotonic() > deadline:
                raise TimeoutError("the calls did not run in parallel")
            time.sleep(0.05)
        return 1.0
    return float(completion == answer)
"""


@pytest.fixture
def reward(tmp_path):
    (tmp_path / "rw.py").write_text(REWARD)
    (tmp_path / "pids").mkdir()
    return f"{tmp_path}/rw.py:judge"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_failures_score_zero_are_counted_by_kind_and_logged_once(reward, tmp_path, caplog):
    pids = str(tmp_path / "pids")
    s = rewards.Scorer(reward, workers=3, timeout=1.0)
    try:
        items = [
            ("p", "2", "2", {}),
            ("p", "3", "2", {}),
            ("p", "x", "2", {"mode": "raise"}),
            ("p", "x", "2", {"mode": "hang", "where": pids}),
            ("p", "x", "2", {"mode": "nan"}),
            ("p", "x", "2", {"mode": "none"}),
            ("p", "x", "2", {"mode": "exit"}),
            ("p", "2", "2", {}),
        ]
        got, failed = s.score(items)
        assert got == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        assert failed == {"raised": 2, "timeout": 1, "nonfinite": 1, "nonnumber": 1, "outofrange": 0}
        (hung,) = (int(p) for p in os.listdir(pids))
        assert not alive(hung)  # killed, and replaced:
        assert s.score([("p", "2", "2", {})] * 4) == ([1.0] * 4, dict.fromkeys(rewards.FAILURES, 0))
        assert s.score(items[2:3])[1]["raised"] == 1
        log = caplog.text
        for kind, message in [
            ("raised", "RuntimeError: cannot judge x"),
            ("timeout", "no answer in 1 s"),
            ("nonfinite", "returned nan"),
            ("nonnumber", "returned NoneType 'None', not a number"),
        ]:
            assert log.count(f"a call failed ({kind})") == 1 and message in log, log
    finally:
        s.close()


def test_a_batchs_calls_run_in_parallel(reward, tmp_path):
    s = rewards.Scorer(reward, workers=3, timeout=120.0)
    try:
        got, failed = s.score([("p", "c", "3", {"mode": "together", "where": str(tmp_path / "pids")})] * 3)
        assert got == [1.0] * 3 and not any(failed.values()), failed
    finally:
        s.close()


def test_a_reward_that_cannot_load_fails_its_calls_and_the_pool_ends_clean(reward, tmp_path):
    s = rewards.Scorer(reward, workers=2, timeout=5.0)
    first = [w.proc for w in s.pool.workers]
    try:
        assert s.score([("p", "1", "1", {})]) == ([1.0], dict.fromkeys(rewards.FAILURES, 0))
        (tmp_path / "broken").touch()
        s.score([("p", "x", "1", {"mode": "exit"})] * 2)  # both processes die; their replacements cannot load
        got, failed = s.score([("p", "1", "1", {})] * 3)
        assert got == [0.0] * 3 and failed["raised"] == 3
    finally:
        workers = [w.proc for w in s.pool.workers]
        s.close()
    assert not [p for p in first + workers if p.is_alive() or alive(p.pid)]
