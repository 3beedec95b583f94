"""A worker's episodes against its real engine (hf, a tiny model) and an environment in processes
of its own: turns appended as tokens, each limit ending its episode with its reason, and an
environment that raises, hangs, dies, or replies malformed ending one episode while the others
run on. Then `sparrowrl run` on the multi-turn example: it trains, every commit verified."""

import json
import subprocess
import textwrap
from functools import partial
from pathlib import Path

import pytest
from support.models import eos_first
from support.servers import EXE

from sparrowrl.agents import environment
from sparrowrl.agents.turns import Turns
from sparrowrl.calls import Pool
from sparrowrl.spec.task import EnvironmentSpec
from sparrowrl.trainer import models
from sparrowrl.worker.engines import Prompt, Sampling, make_engine
from sparrowrl.worker.episodes import Episodes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
EOS = 2
EXAMPLES = Path(__file__).parent.parent / "examples"

ENV = """
    import os, time

    class Env:
        dataset = []
        def env_response(self, messages, state):
            kind = state["info"]["kind"]
            if kind == "raise":
                raise RuntimeError("the environment broke")
            if kind == "hang":
                time.sleep(600)
            if kind == "die":
                os._exit(3)
            if kind == "bad":
                return [{"role": "assistant", "content": "not mine"}]
            if kind == "long":
                return [{"role": "user", "content": "1" * 50}]
            if kind == "once" and state["turn"] >= 2:
                return []
            return [{"role": "user", "content": f"q{state['turn']}"}]
        def reward(self, prompt, completion, answer, **fields):
            return 0.0

    def load_environment():
        return Env()
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The hf engine on a tiny model whose every turn is its EOS (support.models.eos_first): the
    environment sets the pace."""
    folder = tmp_path_factory.mktemp("model")
    state = eos_first(folder)
    hf = make_engine("hf", str(folder))
    for n, t in hf.tensors().items():
        t.copy_(state[n])
    return hf, models.char_tokenizer()


def episodes(engine, tmp_path, **limits):
    hf, tok = engine
    f = tmp_path / "env.py"
    f.write_text(textwrap.dedent(ENV))
    spec = EnvironmentSpec(load=str(f), **{"turn_seconds": 3.0, **limits})
    pool = Pool(partial(environment.turn_caller, spec.load, {}), 2, spec.turn_seconds, "environment")
    return Episodes(hf, Turns(tok, False, {EOS}), spec, pool), pool


def run(driver, kinds, n=2):
    prompts = [Prompt(models.prompt_ids(models.char_tokenizer(), "1+1="), 10 + i) for i in range(len(kinds))]
    examples = [
        {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "fields": {"info": {"kind": k}}}
        for k in kinds
    ]
    return driver.run(prompts, examples, Sampling(n=n, max_new_tokens=3, temperature=1.0))


def test_each_episode_ends_at_its_own_limit_or_fault_and_the_others_run_on(engine, tmp_path):
    driver, pool = episodes(engine, tmp_path, max_turns=3, max_episode_tokens=40)
    try:
        kinds = ["once", "chat", "long", "raise", "hang", "die", "bad"]
        groups = run(driver, kinds)
    finally:
        pool.close()
    tok = engine[1]
    ends = {k: [(s["episode"]["end"], s["episode"]["reason"]) for s in g] for k, g in zip(kinds, groups)}
    assert ends["once"] == [("done", None)] * 2
    assert ends["chat"] == [("max_turns", None)] * 2
    for kind, end, reason in [
        ("long", "max_tokens", "the environment's turn of 50 tokens leaves no room in maxEpisodeTokens (40) after 1"),
        ("raise", "error", "the environment's turn failed (raised): RuntimeError: the environment broke"),
        ("hang", "error", "the environment's turn failed (timeout): no answer in 3 s"),
        ("die", "error", "the environment's turn failed (raised): its process died (exit code 3)"),
        ("bad", "error", "the environment's turn failed (raised): ValueError: env_response's message 0 is not"),
    ]:
        assert all(e == end and r.startswith(reason) for e, r in ends[kind]), (kind, ends[kind])
    once = groups[0][0]
    q1 = tok("q1", add_special_tokens=False).input_ids
    assert once["tokens"] == [EOS, *q1, EOS]  # the model's turns as sampled, the environment's between them
    assert once["logprobs"][1:3] == [0.0, 0.0] and once["episode"]["turns"] == [
        {"at": 1, "tokens": 2, "messages": [{"role": "user", "content": "q1"}]}
    ]
    chat = groups[1][0]
    assert len(chat["episode"]["turns"]) == 2 and chat["tokens"].count(EOS) == 3  # maxTurns: 3 model turns
    # what the trainer reads of them: the same messages, and the model's tokens only trained
    messages, mask = Turns(tok, False, {EOS}).read(once["tokens"], once["episode"])
    assert messages == [
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": ""},
    ]
    assert mask == [True, False, False, True]


def test_an_episode_the_engine_has_no_room_for_ends_on_the_model_s_turn(engine, tmp_path):
    """rollout.maxModelLen: where the engine refuses a batch, each episode is asked alone, and one
    without room ends without the environment's turn that left it none, readable by the trainer."""
    hf, tok = engine
    f = tmp_path / "env.py"
    f.write_text(textwrap.dedent(ENV))
    short = make_engine("hf", str(hf.model_dir), max_model_len=12)
    for n, t in short.tensors().items():
        t.copy_(hf.tensors()[n])
    spec = EnvironmentSpec(load=str(f), max_turns=8, max_episode_tokens=40)
    pool = Pool(partial(environment.turn_caller, spec.load, {}), 2, spec.turn_seconds, "environment")
    turns = Turns(tok, False, {EOS})
    examples = [{"messages": [{"role": "user", "content": p}], "answer": "", "fields": {"info": {"kind": "chat"}}}
                for p in ("1+1=", "11+11=")]  # fmt: skip
    prompts = [Prompt(models.prompt_ids(tok, e["messages"][0]["content"]), 3) for e in examples]
    try:
        a, b = Episodes(short, turns, spec, pool).run(prompts, examples, Sampling(n=1, max_new_tokens=3, temperature=1))
    finally:
        pool.close()
    for [x], prompt, model_turns in ((a, prompts[0], 3), (b, prompts[1], 2)):
        ep = x["episode"]
        assert ep["end"] == "max_tokens" and ep["reason"].startswith("the engine refused the model's next turn")
        assert x["tokens"][-1] == EOS and x["tokens"].count(EOS) == model_turns  # the longer prompt ran out first
        assert len(prompt.ids) + len(x["tokens"]) <= 12
        turns.read(x["tokens"], ep)  # it reads back: the trainer scores and trains it


def test_an_episode_past_its_wall_time_ends_truncated(engine, tmp_path):
    driver, pool = episodes(engine, tmp_path, episode_seconds=0.001)
    try:
        [group] = run(driver, ["chat"], n=1)
    finally:
        pool.close()
    assert group[0]["episode"]["end"] == "timeout" and "episodeSeconds (0.001 s)" in group[0]["episode"]["reason"]


def example(name, tmp_path, steps, light=False, warmup=None):
    """An example job for a few steps, as a user runs it from a fresh clone: its summary, and its
    steps' metrics. `light`: the same model, environment and settings, with one worker, half the
    prompts per step, a tenth of the rows and no eval rounds (and `warmup` steps of the tiny
    model's warm-up, which take most of a short run's CPU): what the test is about, at a fraction
    of the CPU (a 2-core CI runs the heavy tests side by side)."""
    out = tmp_path / "run"
    job = EXAMPLES / name
    if light:
        import shutil

        import yaml

        doc = yaml.safe_load(job.read_text())
        spec = doc["spec"]
        spec["topology"] = {"regions": [{"name": "us", "workers": 1, "relay": False}]}
        spec["task"].pop("eval", None)
        spec["grpo"]["promptsPerStep"] //= 2
        env = spec["task"]["environment"]
        for rows in ("examples", "size"):
            if rows in env.get("args", {}):
                env["args"][rows] //= 10
        if warmup is not None:
            spec["model"]["tiny"]["warmupSteps"] = warmup
        shutil.copytree(EXAMPLES / "envs", tmp_path / "envs")
        job = tmp_path / name
        job.write_text(yaml.safe_dump(doc))
    p = subprocess.run(
        [EXE, "run", str(job), "--run-dir", str(out), "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["weights_mismatch"] == 0 and summary["weights_verified"] >= steps, summary
    return summary, [r for r in rows if "episode_turns_mean" in r]


def test_the_multi_turn_example_trains_with_every_commit_verified(tmp_path):
    summary, steps = example("multi-turn.yaml", tmp_path, 4)
    assert len(steps) == 4
    for r in steps:
        assert 1.0 <= r["episode_turns_mean"] <= 2.0 and r["episode_turns_max"] <= 2
        assert sum(r["episode_ends"].values()) == 16 * 8 and set(r["episode_ends"]) <= {"done", "length"}
        assert r["episode_unread"] == 0 and r["refused_samples"] == {} and r["skipped"] is None
    assert any(r["episode_turns_max"] == 2 for r in steps)  # the environment's second question was asked
    evals = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 4]  # the environment's eval_dataset, as episodes, at v0 and the last
    assert all(e["prompts"] == 64 and e["samples"] == 4 and 0 < e["reward_mean"] < 1 for e in evals), evals


def test_the_verifiers_example_trains_through_verifiers_own_hooks(tmp_path):
    """examples/verifiers.yaml: the same dialogue as a vf.MultiTurnEnv with a vf.Rubric. Its
    episodes run on the worker through verifiers' hooks (its max_turns ends them), and the trainer
    reads every one back and scores it with the rubric."""
    summary, steps = example("verifiers.yaml", tmp_path, 2, light=True, warmup=40)
    assert len(steps) == 2
    for r in steps:
        assert r["episode_turns_max"] == 2 and r["episode_ends"].get("done", 0) > 0, r
        assert r["episode_unread"] == 0 and r["refused_samples"] == {} and r["skipped"] is None
        assert r["reward_failed"] == dict.fromkeys(r["reward_failed"], 0) and 0 < r["reward_mean"] < 1, r


# a chat template whose assistant turns end with EOS, as real ones end with their end-of-turn token
CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}</s>{% else %}<{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def test_a_chat_model_s_episodes_render_on_the_worker_as_the_trainer_reads_them(tmp_path):
    """A user's model folder with a chat template: prompts and the environment's turns are the
    template's (u:...<a:), rendered by the worker after each sampled EOS and again by the trainer,
    which reads every episode back; none is refused."""
    import yaml
    from support import jobs

    eos_first(tmp_path / "model", template=CHAT)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "two_turn_sum.py").write_text((EXAMPLES / "envs" / "two_turn_sum.py").read_text())
    env = {"load": "envs/two_turn_sum.py", "maxTurns": 2, "maxEpisodeTokens": 32}
    spec = {"steps": 2, "model": {"path": "model"}, "grpo": jobs.GRPO, "rollout": {"groupsPerLease": 2}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(jobs.job(task={"environment": env}, **spec)))
    out = tmp_path / "run"
    p = subprocess.run(
        [EXE, "run", str(tmp_path / "job.yaml"), "--run-dir", str(out)], capture_output=True, text=True, timeout=280
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode_ends" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["episode_unread"] == 0 and r["refused_samples"] == {}, r
        assert r["episode_turns_max"] == 2 and r["episode_ends"].get("done", 0) > 0, r


def test_the_tool_example_calls_its_tool_and_trains(tmp_path):
    """examples/tools.yaml: the calculator is called (in processes of its own), its answers are
    appended and read back on the trainer, and the steps train; episodes.png plots them."""
    summary, steps = example("tools.yaml", tmp_path, 3, light=True)
    assert (tmp_path / "run" / "episodes.png").stat().st_size > 0
    assert len(steps) == 3
    for r in steps:
        assert r["episode_tool_calls"] > 0 and r["episode_turns_max"] == 2, r
        assert r["episode_unread"] == 0 and r["refused_samples"] == {} and r["skipped"] is None
        assert r["tokens"] > 0 and r["reward_failed"] == dict.fromkeys(r["reward_failed"], 0)


def test_the_reasoning_gym_example_runs_as_a_task(tmp_path):
    summary, steps = example("reasoning-gym.yaml", tmp_path, 2, light=True, warmup=40)
    assert len(steps) == 2 and all(r["episode_ends"].keys() <= {"done", "length"} for r in steps)
    assert all(r["reward_failed"] == dict.fromkeys(r["reward_failed"], 0) for r in steps)


@pytest.mark.parametrize(
    "fault, message",
    [
        ("", "environment: one episode against a stub model (it answers with the example's answer): 2 model turns"),
        (
            "env_response",
            "spec.task.environment: one episode against a stub model failed: the environment's turn failed (raised): "
            "RuntimeError: env_response broke",
        ),
        ("reward", "its rubric failed on one episode against a stub model (raised): RuntimeError: reward broke"),
    ],
)
def test_check_runs_one_episode_against_a_stub_model(tmp_path, fault, message):
    """`sparrowrl check` (a trainer pod's init container) loads the environment and runs one
    episode before the trainer starts: a broken environment or rubric stops the job there."""
    env = (EXAMPLES / "envs" / "two_turn_sum.py").read_text()
    if fault:
        env = env.replace(
            f"    def {fault}(self, ",
            f"    def {fault}(self, *a, **k):\n        raise RuntimeError('{fault} broke')\n\n    def _{fault}(self, ",
        )
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "two_turn_sum.py").write_text(env)
    (tmp_path / "job.yaml").write_text((EXAMPLES / "multi-turn.yaml").read_text())
    p = subprocess.run([EXE, "check", str(tmp_path / "job.yaml")], capture_output=True, text=True, timeout=120)
    assert (p.returncode == 0) == (not fault), p.stdout + p.stderr
    if fault:
        assert p.returncode == 3 and message in p.stdout + p.stderr, p.stdout + p.stderr
    else:
        assert message in p.stdout, p.stdout


STATEFUL = """
    class Env:
        dataset = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(9)]
        def env_response(self, messages, state):
            state["seen"] = messages[-1]["content"]  # what only the worker keeps
            return []
        def reward(self, prompt, completion, answer, state, **fields):
            return 0.7 if "seen" in state else 0.1

    def load_environment():
        return Env()
"""


def test_a_rubric_that_needs_state_is_refused_unless_worker_rewards_are_trusted(tmp_path):
    """The trainer scores transcripts; a rubric that reads the worker's state is refused at the
    check, naming trustWorkerRewards. With it set, the workers' own scores train the job, and the
    metrics say whose they are."""
    import yaml
    from support import jobs

    (tmp_path / "env.py").write_text(textwrap.dedent(STATEFUL))
    environment = {"load": "env.py", "maxTurns": 2, "maxEpisodeTokens": 8}
    spec = {
        "steps": 2,
        "model": jobs.tiny(warmupSteps=100),  # enough to end some turns with EOS (those the environment sees)
        "grpo": jobs.GRPO | {"maxNewTokens": 4},
        "rollout": {"groupsPerLease": 2},
    }
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(jobs.job(task={"environment": environment}, **spec)))
    p = subprocess.run([EXE, "check", str(f)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "takes `state`, which stays on the worker" in p.stderr + p.stdout, p.stderr
    assert "task.environment.trustWorkerRewards" in p.stderr + p.stdout
    f.write_text(yaml.safe_dump(jobs.job(task={"environment": environment | {"trustWorkerRewards": True}}, **spec)))
    out = tmp_path / "run"
    p = subprocess.run([EXE, "run", str(f), "--run-dir", str(out)], capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "episode_ends" in r]
    assert len(steps) == 2 and all(r["reward_from_workers"] for r in steps)
    for r in steps:  # 0.7 where the environment took its turn (its state), 0.1 where a turn was cut first
        done = r["episode_ends"].get("done", 0) / sum(r["episode_ends"].values())
        assert r["reward_mean"] == pytest.approx(0.1 + 0.6 * done, abs=1e-5), r
    assert any(r["episode_ends"].get("done") for r in steps)
