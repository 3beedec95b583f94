"""`sparrowrl run` on users' tasks, end to end: a model folder whose tokenizer has a chat
template, chat-shaped JSONL whose extra fields reach the reward, and a reward that fails in every
way it can while the job trains on."""

import json
import os
import subprocess

import pytest
import yaml
from support.servers import EXE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def job(**spec) -> dict:
    return {
        "apiVersion": "sparrowrl.dev/v1alpha1",
        "kind": "SparrowRLJob",
        "metadata": {"name": "t"},
        "spec": {
            "steps": 2,
            "seed": 7,
            "grpo": {"learningRate": 1e-3, "groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3},
            "rollout": {"groupsPerLease": 1},
            "sync": {"staleness": 0},
            "topology": {"regions": [{"name": "a", "workers": 1}, {"name": "b", "workers": 1, "relay": False}]},
            **spec,
        },
    }


def run(tmp_path, spec: dict, name: str = "run") -> subprocess.CompletedProcess:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [EXE, "run", str(f), "--run-dir", str(tmp_path / name)],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def results(out) -> tuple[dict, list[dict]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), rows


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_chat_template_chat_lines_and_a_reward_that_reads_a_field(tmp_path):
    from sparrowrl.trainer import models

    tok = models.char_tokenizer()
    tok.chat_template = TEMPLATE
    models.tiny_qwen3(len(tok), 32, 1, 2, 0).save_pretrained(tmp_path / "pretrained")
    tok.save_pretrained(tmp_path / "pretrained")
    (tmp_path / "qa.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{a}*2="}], "answer": str(2 * a), "digits": 1}) + "\n"
            for a in range(6)
        )
        + "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "digits": 2}) + "\n" for a in range(4))
    )
    (tmp_path / "myreward.py").write_text(
        "def leading(prompt, completion, answer, digits):\n"
        "    if not (prompt.startswith('s:be brief<u:') and prompt.endswith('<a:')):\n"
        "        raise ValueError(f'not the rendered prompt: {prompt!r}')\n"
        "    return float(completion[:digits] == answer[:digits])\n"
        "def narrow(prompt, completion, answer):\n"
        "    return 1.0\n"
    )
    task = {"jsonl": "qa.jsonl", "reward": "myreward:leading", "systemPrompt": "be brief"}
    r = run(tmp_path, job(model={"path": "pretrained"}, task=task))
    assert r.returncode == 0, r.stderr[-3000:]
    s, rows = results(tmp_path / "run")
    assert s["steps"] == 2 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * 3
    assert s["reward_failed"] == {"raised": 0, "timeout": 0, "nonfinite": 0, "nonnumber": 0}  # every prompt rendered
    assert all(0.0 <= x["reward_mean"] <= 1.0 for x in rows)
    assert (tmp_path / "run" / "final" / "chat_template.jinja").read_text() == TEMPLATE

    r = run(tmp_path, job(model={"path": "pretrained"}, task={**task, "reward": "myreward:narrow"}), "narrow")
    assert r.returncode == 1 and "spec.task: reward 'myreward.py:narrow' cannot be called" in r.stderr.replace(
        str(tmp_path) + "/", ""
    ), r.stderr
    assert "the fields digits" in r.stderr and not (tmp_path / "narrow").exists()


REWARD = """\
import math, os, pathlib, time


def judge(prompt, completion, answer, mode, where):
    pathlib.Path(where, str(os.getpid())).touch()
    if mode == "raise":
        raise RuntimeError("cannot judge " + completion)
    if mode == "hang":
        time.sleep(3600)
    if mode == "nan":
        return math.nan
    if mode == "none":
        return None
    return float(completion[:1] == answer[:1])
"""


def test_a_reward_that_raises_hangs_or_returns_nan_stops_nothing(tmp_path):
    """Each batch holds one group of each mode: 4 samples of each kind of failure per step."""
    pids = tmp_path / "pids"
    pids.mkdir()
    modes = ["ok", "raise", "hang", "nan", "none"]
    (tmp_path / "qa.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "mode": m, "where": str(pids)}) + "\n"
            for i, m in enumerate(modes)
        )
    )
    (tmp_path / "rw.py").write_text(REWARD)
    spec = job(
        model={"tiny": {"hidden": 32, "layers": 1, "heads": 2, "warmupSteps": 10}},
        task={"jsonl": "qa.jsonl", "reward": "rw:judge", "rewardWorkers": 4, "rewardTimeoutSeconds": 1},
    )
    spec["spec"]["grpo"]["promptsPerStep"] = 5
    r = run(tmp_path, spec)
    assert r.returncode == 0, r.stderr[-3000:]
    s, rows = results(tmp_path / "run")
    assert s["steps"] == 2 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * 3
    for x in rows:
        assert x["reward_failed"] == {"raised": 4, "timeout": 4, "nonfinite": 4, "nonnumber": 4}, x
    assert s["reward_failed"] == {"raised": 8, "timeout": 8, "nonfinite": 8, "nonnumber": 8}
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    for kind in ("raised", "timeout", "nonfinite", "nonnumber"):
        assert log.count(f"a call failed ({kind})") == 1, log[-3000:]
    assert "RuntimeError: cannot judge" in log and "no answer in 1 s" in log
    called = [int(p.name) for p in pids.iterdir()]
    assert len(called) >= 4 and not [p for p in called if alive(p)]  # hung ones killed, the rest ended with the trainer
