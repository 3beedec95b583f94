"""Log lines (sparrowrl/logs.py): text is the message alone, in the words people and tests grep;
json is one object a line with the keys log pipelines read. And a role started by hand writes
them as its --log-format or SPARROWRL_LOG_FORMAT says."""

import json
import logging
import os
import subprocess
import sys
from datetime import datetime, timedelta

import pytest
import torch
from support.bounded import EXE, free_port
from support.wait import listening, until

from sparrowrl import logs
from sparrowrl.store.store import Store


@pytest.fixture
def sparrowrl_logger(monkeypatch):
    """The `sparrowrl` logger as a test found it, again after the test: `setup` changes it for the process."""
    logger = logging.getLogger(logs.ROOT)
    saved = logger.handlers[:], logger.level, logger.propagate
    for name in (logs.FORMAT_ENV, logs.LEVEL_ENV):  # set, then unset: undone as the test found them (setup sets them)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def record(msg: str, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("sparrowrl.trainer.trainer", logging.WARNING, __file__, 1, msg, (), exc_info)


def test_text_is_the_message_alone(sparrowrl_logger, capsys):
    log = logging.getLogger("sparrowrl.trainer.trainer")
    logs.setup("text")
    log.warning("trainer: refused 16 samples of worker worker-b-0 at step 3 (16 mismatch)")
    log.info("trainer: step %d/%d", 3, 20)
    assert capsys.readouterr().out == (
        "trainer: refused 16 samples of worker worker-b-0 at step 3 (16 mismatch)\ntrainer: step 3/20\n"
    )
    try:
        raise ValueError("bad weights")
    except ValueError:
        log.exception("trainer: export failed")
    first, *trace = capsys.readouterr().out.splitlines()
    assert (
        first == "trainer: export failed"
        and trace[0].startswith("Traceback")
        and trace[-1] == "ValueError: bad weights"
    )


def test_json_is_one_object_a_line_with_the_keys_pipelines_read():
    r = record('trainer: no weight changed at step 3 ("nonfinite")\nsecond line')
    line = logs.JsonFormatter().format(r)
    assert "\n" not in line
    got = json.loads(line)
    assert set(got) == {"time", "level", "logger", "message"}
    assert got["level"] == "warning" and got["logger"] == "sparrowrl.trainer.trainer"
    assert got["message"] == 'trainer: no weight changed at step 3 ("nonfinite")\nsecond line'
    when = datetime.fromisoformat(got["time"])
    assert when.utcoffset() == timedelta(0) and abs(when.timestamp() - r.created) < 1e-3


def test_json_carries_the_exception():
    try:
        raise ValueError("bad weights")
    except ValueError as e:
        got = json.loads(logs.JsonFormatter().format(record("sparrowrl: update failed", exc_info=(type(e), e, None))))
    assert got["message"] == "sparrowrl: update failed" and got["exception"].endswith("ValueError: bad weights")


def test_setup_writes_each_line_once_to_stdout_in_its_format(sparrowrl_logger, capsys):
    log = logging.getLogger("sparrowrl.worker.worker")
    logs.setup("text", "info")
    logs.setup("json", "info")  # replaces the first: one handler
    log.info("worker-0: v1 staged")
    log.debug("not at info")
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["message"] == "worker-0: v1 staged"
    logs.setup("text", "warning")
    log.info("not at warning")
    log.warning("worker-0: pace missed")
    assert capsys.readouterr().out == "worker-0: pace missed\n"
    assert not sparrowrl_logger.propagate  # a root logger that the host process configured would say it again
    with pytest.raises(ValueError, match="log format 'yaml'"):
        logs.setup("yaml")  # type: ignore[arg-type]


def test_adopt_takes_the_environment_and_keeps_a_setup_made(sparrowrl_logger, capsys, monkeypatch):
    """The vLLM plugin's call: in vLLM's processes as the environment says; in a worker's own
    process (its in-process vLLM engine loads the plugin) as the worker's flags said."""
    log = logging.getLogger("sparrowrl.integrations.vllm_backend")
    sparrowrl_logger.handlers[:] = [h for h in sparrowrl_logger.handlers if not isinstance(h, logs.Stdout)]
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    monkeypatch.setenv(logs.LEVEL_ENV, "WARNING")
    logs.adopt()
    log.info("not at warning")
    log.error("sparrowrl: v3: vLLM's reload failed")
    assert json.loads(capsys.readouterr().out)["level"] == "error"
    logs.setup("text")
    logs.adopt()
    log.info("sparrowrl: serving v3")
    assert capsys.readouterr().out == "sparrowrl: serving v3\n"


def test_adopt_never_stops_a_process_over_a_value_it_cannot_read(sparrowrl_logger, capsys, monkeypatch):
    """vLLM calls the plugin unguarded: `JSON` is json, and a format or level it does not know is
    text at info, not an exception that would stop every `vllm serve` on the machine."""
    log = logging.getLogger("sparrowrl.integrations.vllm_backend")
    for fmt, level, want in (("JSON", "Warning", "json"), ("xml", "trace", "text")):
        sparrowrl_logger.handlers[:] = [h for h in sparrowrl_logger.handlers if not isinstance(h, logs.Stdout)]
        monkeypatch.setenv(logs.FORMAT_ENV, fmt)
        monkeypatch.setenv(logs.LEVEL_ENV, level)
        logs.adopt()
        log.info("sparrowrl: serving v3")
        out = capsys.readouterr().out
        assert out == ("" if want == "json" else "sparrowrl: serving v3\n"), (fmt, level, out)


@pytest.mark.e2e
def test_setup_hands_its_format_to_the_processes_this_one_starts(sparrowrl_logger):
    """A trainer's ranks and vLLM's engine processes `adopt` what the environment says: a format
    given as a flag reaches them too."""
    logs.setup("json", "warning")
    assert (os.environ[logs.FORMAT_ENV], os.environ[logs.LEVEL_ENV]) == ("json", "warning")
    code = "from sparrowrl import logs; import logging; logs.adopt(); logging.getLogger('sparrowrl.x').warning('w')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["message"] == "w"


@pytest.mark.e2e
def test_a_role_started_by_hand_logs_in_the_format_asked(tmp_path):
    """`sparrowrl serve` four times at once: --log-format json, SPARROWRL_LOG_FORMAT=json, the
    default (text: the banner's words alone), and SPARROWRL_LOG_LEVEL=warning (nothing to say)."""
    store = tmp_path / "store"
    Store.init(store, {"w": torch.zeros(8, dtype=torch.bfloat16)})
    env = {k: v for k, v in os.environ.items() if k not in ("SPARROWRL_TOKEN", logs.FORMAT_ENV, logs.LEVEL_ENV)}
    cases = {
        "flag": (["--log-format", "json"], {}),
        "env": ([], {logs.FORMAT_ENV: "json"}),
        "text": ([], {}),
        "quiet": ([], {logs.LEVEL_ENV: "warning"}),
    }
    procs = {}
    for name, (flags, more) in cases.items():
        port = free_port()
        procs[name] = (
            port,
            subprocess.Popen(
                [str(EXE), "serve", str(store), "--port", str(port), *flags],
                env={**env, **more},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    out = {}
    try:
        for name, (port, p) in procs.items():
            until(lambda: listening(port), 120, f"sparrowrl serve ({name}) on port {port}", every=0.1, alive={name: p})
    finally:
        for name, (port, p) in procs.items():
            p.terminate()
            out[name] = p.communicate(timeout=30)
    banner = f"serving {store} on http://127.0.0.1:{{}}/v1/versions (no token: loopback only)"
    for name in ("flag", "env"):
        stdout, stderr = out[name]
        lines = [json.loads(line) for line in stdout.splitlines()]
        assert lines and all({"time", "level", "logger", "message"} <= set(x) for x in lines), (stdout, stderr)
        last = lines[-1]
        assert (last["level"], last["logger"], last["message"]) == (
            "info",
            "sparrowrl.cli.net",
            banner.format(procs[name][0]),
        ), lines
    assert out["text"][0] == banner.format(procs["text"][0]) + "\n", out["text"]
    assert out["quiet"][0] == "", out["quiet"]


def test_a_test_that_set_up_logs_leaves_no_environment_behind():
    """Tests after one of this file's would otherwise start their roles logging JSON (pytest's order)."""
    assert logs.FORMAT_ENV not in os.environ and logs.LEVEL_ENV not in os.environ
