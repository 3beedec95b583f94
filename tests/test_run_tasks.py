"""`sparrowrl run` on users' tasks, end to end: a model folder whose tokenizer has a chat
template, chat-shaped JSONL whose extra fields reach the reward, and a reward that fails in every
way it can while the job trains on."""

import json
import os
import subprocess

import pytest
import yaml
from support import jobs
from support.servers import EXE

from sparrowrl.trainer import rewards

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def job(**spec) -> dict:
    """The tiny job as these runs make it: two steps, a worker in each of two regions."""
    return jobs.job(
        **{
            "steps": 2,
            "seed": 7,
            "grpo": {"learningRate": 1e-3, **jobs.GRPO},
            "rollout": {"groupsPerLease": 1},
            "sync": {"staleness": 0},
            "topology": jobs.TWO_REGIONS,
            **spec,
        }
    )


def run(tmp_path, spec: dict, name: str = "run", env: dict | None = None, *flags: str) -> subprocess.CompletedProcess:
    """`sparrowrl run`, offline unless `env` says otherwise (the stand-in hub's address)."""
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(spec))
    return subprocess.run(
        [EXE, "run", str(f), "--run-dir", str(tmp_path / name), *flags],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
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
    if mode == "huge":
        return 1e300
    return float(completion[:1] == answer[:1])
"""


def test_a_reward_that_raises_hangs_or_returns_nan_stops_nothing(tmp_path):
    """Each batch holds one group of each mode: 4 samples of each kind of failure per step. A
    reward beyond MAX_REWARD would overflow the advantages: it counts as a failure too."""
    pids = tmp_path / "pids"
    pids.mkdir()
    modes = ["ok", "raise", "hang", "nan", "none", "huge"]
    (tmp_path / "qa.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i), "mode": m, "where": str(pids)}) + "\n"
            for i, m in enumerate(modes)
        )
    )
    (tmp_path / "rw.py").write_text(REWARD)
    spec = job(
        model=jobs.tiny(warmupSteps=10),
        task={"jsonl": "qa.jsonl", "reward": "rw:judge", "rewardWorkers": 4, "rewardTimeoutSeconds": 1},
    )
    spec["spec"]["grpo"]["promptsPerStep"] = 6
    r = run(tmp_path, spec)
    assert r.returncode == 0, r.stderr[-3000:]
    s, rows = results(tmp_path / "run")
    assert s["steps"] == 2 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * 3
    for x in rows:
        assert x["reward_failed"] == dict.fromkeys(rewards.FAILURES, 4), x
        assert x["loss"] is not None and x["skipped"] != "nonfinite", x  # 1e300 reached no advantage
    assert s["reward_failed"] == dict.fromkeys(rewards.FAILURES, 8)
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    for kind in rewards.FAILURES:
        assert log.count(f"a call failed ({kind})") == 1, log[-3000:]
    assert "RuntimeError: cannot judge" in log and "no answer in 1 s" in log
    called = [int(p.name) for p in pids.iterdir()]
    assert len(called) >= 4 and not [p for p in called if alive(p)]  # hung ones killed, the rest ended with the trainer


PARTIAL = """\
import secrets, tabnanny


def partial(prompt, completion, answer, scale):
    if not (prompt.startswith("u:") and prompt.endswith("<a:")):
        raise ValueError(f"not the rendered prompt: {prompt!r}")
    hits = sum(a == b for a, b in zip(completion, answer))
    return scale * hits / max(len(answer), len(completion), 1)


def narrow(prompt, completion, answer):
    return 1.0
"""


def test_a_pretrained_folder_then_the_same_model_and_data_from_the_hub(tmp_path):
    """The issue's "done when": a model folder with a chat template, chat lines (and plain ones)
    with a field the reward reads, micro-batches and a cosine schedule; the reward rises and every
    commit verifies. The reward module beside the job file is found, not the standard library's
    names there. A reward that cannot take the lines' fields is refused before anything starts.
    Then the same model and data from the stand-in hub (a private model: HF_TOKEN), which the
    trainer downloads into its state dir (that a restart asks the hub nothing: tests/test_hub.py)."""
    from support.hub import Hub
    from support.models import TEMPLATE, chat_tokenizer

    from sparrowrl.store.store import Store
    from sparrowrl.trainer import models, tasks

    tok = chat_tokenizer()
    prompts = models.Prompts(tok)
    model = models.tiny_qwen3(len(tok), 64, 1, 2, 0)
    models.warm_up(model, prompts, tasks.Add(0, prompts), 300)  # knows sums, often runs on: RL's starting point
    model.save_pretrained(tmp_path / "pretrained")
    tok.save_pretrained(tmp_path / "pretrained")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "scale": 1})
            + "\n"
            for a in range(10)
            for b in range(10)
        )
    )
    plain = "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "scale": 1}) + "\n" for a in range(10))
    (tmp_path / "mixed.jsonl").write_text((tmp_path / "data" / "train.jsonl").read_text() + plain)
    (tmp_path / "sums.py").write_text(PARTIAL)
    for shadow in ("secrets.py", "tabnanny.py"):  # the standard library's, in every process: never these
        (tmp_path / shadow).write_text(f"open({str(tmp_path / 'shadowed')!r}, 'w').close()\n")
    steps, budget = 12, 200
    grpo = {"learningRate": 1e-3, "groupSize": 8, "promptsPerStep": 8, "maxNewTokens": 4, "microBatchTokens": budget}
    grpo |= {"lrSchedule": "cosine", "warmupSteps": 3}
    assert 8 * 8 * (len(prompts.ids("u:1+2=<a:")) + 4) > 3 * budget  # a step takes several passes
    spec = job(model={"path": "pretrained"}, task={"jsonl": "mixed.jsonl", "reward": "sums:partial"})
    spec["spec"] |= {"steps": steps, "grpo": grpo, "rollout": {"groupsPerLease": 2}}
    r = run(tmp_path, spec)
    assert r.returncode == 0, r.stderr[-3000:]
    s, rows = results(tmp_path / "run")
    assert s["steps"] == steps and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * (steps + 1)
    assert s["reward_failed"] == dict.fromkeys(rewards.FAILURES, 0)
    lrs = [x["lr"] for x in rows]
    assert lrs[0] < lrs[2] == pytest.approx(1e-3) and lrs[2] > lrs[steps // 2] > lrs[-1]  # warm-up, then cosine
    first, last = (sum(x["reward_mean"] for x in part) / len(part) for part in (rows[:4], rows[-4:]))
    assert last > first + 0.05, (first, last)
    v0 = Store(tmp_path / "run" / "store").versions[0].state_hash
    assert (tmp_path / "run" / "final" / "chat_template.jinja").read_text() == TEMPLATE
    assert not (tmp_path / "shadowed").exists()  # no process imported secrets.py from the job's folder
    spec["spec"]["task"]["reward"] = "sums:narrow"
    r = run(tmp_path, spec, "narrow")
    assert r.returncode == 1 and "spec.task: reward 'sums.py:narrow' cannot be called" in r.stderr.replace(
        str(tmp_path) + "/", ""
    ), r.stderr
    assert "the fields scale" in r.stderr and not (tmp_path / "narrow").exists()

    with Hub() as hub:
        hub.add("model", "me/pretrained", tmp_path / "pretrained", private=True)
        hub.add("dataset", "me/sums", tmp_path / "data")
        env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_TOKEN": hub.token, "HF_HOME": str(tmp_path / "hf")}
        spec = job(
            model={"hub": {"repo": "me/pretrained"}},
            task={"dataset": {"path": "me/sums", "messagesField": "messages"}, "reward": "sums:partial"},
        )
        spec["spec"] |= {"steps": 2, "grpo": grpo, "rollout": {"groupsPerLease": 2}}
        r = run(tmp_path, spec, "hub", env)
        assert r.returncode == 0, r.stderr[-3000:]
        asked = len(hub.requests)
    s, rows = results(tmp_path / "hub")
    assert s["steps"] == 2 and s["weights_mismatch"] == 0 and s["weights_verified"] == 2 * 3
    assert s["reward_failed"] == dict.fromkeys(rewards.FAILURES, 0)  # "scale" came along
    assert Store(tmp_path / "hub" / "store").versions[0].state_hash == v0  # the same weights, bit for bit
    log = (tmp_path / "hub" / "logs" / "trainer.log").read_text()
    assert log.count("downloading model me/pretrained") == 1 and log.count("downloading dataset me/sums") == 1
    assert asked > 0 and (tmp_path / "hub" / "hub" / "models" / "me" / "pretrained" / "main.commit").is_file()
