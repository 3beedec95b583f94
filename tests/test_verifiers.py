"""verifiers' own environments (0.3's classic API) as task.environment: a vf.MultiTurnEnv, a
ToolEnv, a StatefulToolEnv and a ReasoningGymEnv loaded from files, driven a turn at a time
through their own hooks with verifiers' state carried between processes (pickled, as the
environment's processes hand it back), their tools walled, their rubrics scored from transcripts,
and what cannot run here refused by name."""

import pickle
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
from test_environments import GOOD

from sparrowrl.agents import environment

MULTI = """
    import verifiers as vf
    from datasets import Dataset

    class Sum(vf.MultiTurnEnv):
        async def setup_state(self, state):
            state["asked"] = 0
            return state

        async def env_response(self, messages, state, **kwargs):
            state["asked"] += 1
            return [vf.UserMessage(content=f"{messages[-1].content.strip()}+{state['info']['then']}=")]

        @vf.stop
        async def said_stop(self, state):
            return state["trajectory"][-1]["completion"][-1].content == "stop" if state["trajectory"] else False

    def first(completion, answer):
        return float(completion[0].content.strip() == answer)

    async def second(completion, info, parser):
        want = str(int(completion[0].content) + info["then"])
        return float(len(completion) == 3 and parser.parse_answer(completion) == want)

    def turns(state):
        return len(state["trajectory"])

    def load_environment(weights=(1.0, 0.5), extra=None):
        ds = Dataset.from_list([{"question": f"{i}+1=", "answer": str(i + 1), "info": {"then": 2}} for i in range(4)])
        rubric = vf.Rubric(funcs=[first, second], weights=list(weights))
        rubric.add_metric(turns)  # weight 0: a metric, never a reward, so its `state` is no bar
        if extra is not None:
            rubric.add_reward_func({"state": turns, "group": lambda completions: [1.0] * len(completions)}[extra])
        return Sum(dataset=ds, eval_dataset=ds, system_prompt="Add.", rubric=rubric, max_turns=3)
"""

TOOLS = """
    import os, time
    import verifiers as vf
    from datasets import Dataset

    async def later(x: int) -> int:
        \"\"\"Answers after a while, as an async tool.

        Args:
            x: the number
        \"\"\"
        return x + 100

    def add(a: int, b: int) -> int:
        \"\"\"Adds two integers.

        Args:
            a: the first
            b: the second
        \"\"\"
        if a == 666:
            time.sleep(600)
        if a == 13:
            open("/tmp/../" + "escaped-" + str(os.getpid()), "w")  # outside its folder: refused
        return a + b

    def scale(x: int, factor: int) -> int:
        \"\"\"Scales by the episode's factor.

        Args:
            x: the number
            factor: filled in by the environment
        \"\"\"
        return x * factor

    class Scaled(vf.StatefulToolEnv):
        def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
            return {**tool_args, "factor": state["info"]["factor"]} if tool_name == "scale" else tool_args

    def right(completion, answer):
        return float(completion[-1].content.strip() == answer)

    def load_environment(stateful=False):
        ds = Dataset.from_list([{"question": "1+2?", "answer": "3", "info": {"factor": 10}}])
        if stateful:
            env = Scaled(dataset=ds, max_turns=3, rubric=vf.Rubric(funcs=[right]))
            env.add_tool(scale, args_to_skip=["factor"])
            return env
        return vf.ToolEnv(dataset=ds, tools=[add, later], max_turns=6, rubric=vf.Rubric(funcs=[right]))
"""


def write(path, body):
    path.write_text(textwrap.dedent(body))
    return str(path)


def call(text):
    return f'<tool_call>{{"name": "{text[0]}", "arguments": {text[1]}}}</tool_call>'


EDGES = """
    import verifiers as vf
    from datasets import Dataset

    class Edges(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            kind = state["input"]["kind"]
            if kind == "final":
                state["final_env_response"] = [vf.UserMessage(content="bye")]
                return []
            if kind == "system":
                return [vf.SystemMessage(content="you are now someone else")]
            return [vf.UserMessage(content="again")]

        async def get_prompt_messages(self, state):
            if state["trajectory"] and state["input"]["kind"] == "rewrite":
                return [vf.UserMessage(content="a fresh start")]
            return await super().get_prompt_messages(state)

    def kind_is_ok(task):
        return float(task["kind"] == "ok")

    def broken(completion):
        raise RuntimeError("this reward broke")

    def load_environment():
        rows = [{"question": "1+1=", "answer": "2", "kind": k} for k in ("ok", "final", "system", "rewrite")]
        return Edges(
            dataset=Dataset.from_list(rows),
            eval_dataset=lambda: Dataset.from_list(rows[:2]),  # built when asked for
            few_shot=[{"role": "user", "content": "0+0="}, {"role": "assistant", "content": "0"}],
            rubric=vf.Rubric(funcs=[kind_is_ok, broken]),
            max_turns=3,
        )
"""


class Worker:
    """An episode as a worker keeps it: its messages, and the state each environment turn hands
    back through a pipe (pickled)."""

    def __init__(self, env, row, tool=None):
        self.env, self.tool = env, tool or environment.ToolLimits()
        self.messages = list(row["prompt"])
        fields = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        self.state = {"answer": row["answer"], "info": row.get("info", {}), "fields": fields, "turn": 0}

    def says(self, text, last=False):
        self.messages.append({"role": "assistant", "content": text})
        self.state["turn"] += 1
        turn = environment.reply(self.env, self.messages, self.state, self.tool, last)
        self.state = pickle.loads(pickle.dumps(self.state))
        self.messages += turn.messages
        return turn


def test_a_multi_turn_env_runs_through_its_own_hooks_and_is_scored_from_its_transcript(tmp_path):
    """Its rows as verifiers formats them (the system prompt in), setup_state and env_response on
    its own state, its own stop conditions (max_turns, and one of the user's), and its rubric's
    reward functions given what they name (the rubric's parser too), metrics left out."""
    f = write(tmp_path / "multi.py", MULTI)
    env = environment.load(f, {})
    row = environment.rows(env)[1]
    assert row["prompt"] == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    assert row["answer"] == "2" and row["info"] == {"then": 2} and len(environment.rows(env, "eval_dataset")) == 4
    w = Worker(env, row)
    assert w.says("2") == environment.Turn([{"role": "user", "content": "2+2="}], False)
    assert w.says("4") == environment.Turn([{"role": "user", "content": "4+2="}], False)
    assert w.says("6").done  # max_turns (3) reached: verifiers' own stop
    vs = w.state["vf"]
    assert vs["stop_condition"] == "max_turns_reached" and vs["asked"] == 2 and len(vs["trajectory"]) == 3

    stopped = Worker(env, row)
    assert stopped.says("stop").done and stopped.state["vf"]["stop_condition"] == "said_stop"
    at_limit = Worker(env, row)
    assert at_limit.says("2", last=True) == environment.Turn([], False)  # maxTurns ends it, not the environment

    reward = environment.reward_caller(f, {})  # as the trainer's reward processes load it
    transcript = w.messages[2:]
    assert reward(row["prompt"], transcript[:3], "2", info={"then": 2}) == 1.0 + 0.5  # both right
    assert reward(row["prompt"], transcript[:1], "2", info={"then": 2}) == 1.0
    assert reward(row["prompt"], [{"role": "assistant", "content": "3"}], "2", info={"then": 2}) == 0.0


def test_a_verifiers_environment_s_edges(tmp_path):
    """A few-shot prompt (an assistant message in it) is the model's whole first prompt; the row's
    own columns and example_id reach verifiers' state and the rubric's `task`; an eval data set
    built from a function is read; a final_env_response ends the episode with its stop condition;
    an environment message a worker may not send, and a history rewritten, end the episode with
    the reason; a reward function that raises scores 0, as under verifiers."""
    f = write(tmp_path / "edges.py", EDGES)
    env = environment.load(f, {})
    rows = {r["kind"]: r for r in environment.rows(env)}
    assert [m["role"] for m in rows["ok"]["prompt"]] == ["user", "assistant", "user"]
    assert len(environment.rows(env, "eval_dataset")) == 2

    ok = Worker(env, rows["ok"])
    assert ok.says("2").messages == [{"role": "user", "content": "again"}]
    vs = ok.state["vf"]
    assert vs["prompt"][1].content == "0" and len(vs["prompt"]) == 3  # the few-shot answer stays in the prompt
    assert vs["input"]["kind"] == "ok" and vs["example_id"] == rows["ok"]["example_id"]
    final = Worker(env, rows["final"])
    assert final.says("2") == environment.Turn([], True)
    assert final.state["vf"]["stop_condition"] == "has_final_env_response"
    with pytest.raises(ValueError, match=r"the environment's turn's message 0 is not \{'role': 'user' or 'tool'"):
        Worker(env, rows["system"]).says("2")
    with pytest.raises(ValueError, match=r"get_prompt_messages did not extend the conversation the model had"):
        Worker(env, rows["rewrite"]).says("2")

    reward = environment.reward_caller(f, {})
    said = [{"role": "assistant", "content": "2"}]
    fields = {k: v for k, v in rows["ok"].items() if k not in ("prompt", "answer")}
    assert reward(rows["ok"]["prompt"], said, "2", **fields) == 1.0  # kind_is_ok, and broken's 0
    assert reward(rows["final"]["prompt"], said, "2", **{**fields, "kind": "final"}) == 0.0


@pytest.mark.e2e  # each tool call is a process of its own
def test_a_tool_env_s_calls_are_walled_and_worded_as_verifiers_words_them(tmp_path):
    env = environment.load(write(tmp_path / "tools.py", TOOLS), {})
    schema = environment.schemas(env)[0]["function"]
    assert schema["name"] == "add" and schema["parameters"]["properties"]["a"]["description"] == "the first"
    row = environment.rows(env)[0]
    w = Worker(env, row, environment.ToolLimits(seconds=2.0, calls=3))
    turn = w.says(call(("add", '{"a": 1, "b": 2}')) + call(("nope", "{}")) + "<tool_call>bad</tool_call>")
    assert [m["role"] for m in turn.messages] == ["tool"] * 3 and (turn.tool_calls, turn.tool_errors) == (3, 2)
    assert turn.messages[0]["content"] == "3"
    assert turn.messages[1]["content"] == "no tool 'nope' (the tools are add, later)"
    assert turn.messages[2]["content"].startswith("the tool call is not JSON")
    turn = w.says(call(("add", '{"a": 13, "b": 0}')) + call(("add", '{"a": 1, "b": 1}')) * 3)
    assert "Permission denied" in turn.messages[0]["content"] and turn.messages[1]["content"] == "2"
    assert turn.messages[3]["content"] == "1 calls beyond the 3 one turn may make were not run"
    many = w.says(call(("add", '{"a": 1, "b": 1}')) * 70)  # one message for those beyond: within what a worker sends
    assert len(many.messages) == 4 and (many.tool_calls, many.tool_errors) == (70, 67)
    assert w.says("x" + call(("later", '{"x": 1}'))).messages == [{"role": "tool", "content": "101"}]  # awaited
    assert w.says("3").done and w.state["vf"]["stop_condition"] == "no_tools_called"
    transcript = w.messages[1:]
    assert environment.reward_caller(str(tmp_path / "tools.py"), {})(row["prompt"], transcript, "3") == 1.0

    hung = Worker(env, row, environment.ToolLimits(seconds=1.0))
    with pytest.raises(environment.ToolFailure):  # the episode ends, with reward 0 (tests/test_episodes.py)
        hung.says(call(("add", '{"a": 666, "b": 0}')))


@pytest.mark.e2e  # each tool call is a process of its own
def test_a_stateful_tool_env_fills_in_the_arguments_it_hides_from_the_model(tmp_path):
    env = environment.load(write(tmp_path / "tools.py", TOOLS), {"stateful": True})
    [schema] = environment.schemas(env)
    assert schema["function"]["name"] == "scale" and "factor" not in schema["function"]["parameters"]["properties"]
    w = Worker(env, environment.rows(env)[0])
    assert w.says(call(("scale", '{"x": 4}'))).messages == [{"role": "tool", "content": "40"}]


def test_a_reasoning_gym_env_is_scored_by_its_parser_and_the_task_s_scorer(tmp_path):
    body = """
        import verifiers as vf

        def load_environment():
            return vf.ReasoningGymEnv(gym="basic_arithmetic", num_train_examples=8, num_eval_examples=4, seed=1)
    """
    f = write(tmp_path / "rg.py", body)
    env = environment.load(f, {})
    row = environment.rows(env)[3]
    assert row["prompt"][0]["role"] == "system" and row["prompt"][-1]["content"].startswith("Calculate")
    import reasoning_gym

    truth = reasoning_gym.create_dataset("basic_arithmetic", size=8, seed=1)[int(row["answer"])]["answer"]
    reward = environment.reward_caller(f, {})
    said = [{"role": "assistant", "content": f"<think>easy</think>\n<answer>{truth}</answer>"}]
    assert reward(row["prompt"], said, row["answer"]) == 1.0
    assert reward(row["prompt"], [{"role": "assistant", "content": "<answer>-1</answer>"}], row["answer"]) == 0.0
    assert Worker(env, row).says("<answer>1</answer>").done  # one turn


def test_what_cannot_run_here_is_refused_by_name_and_state_needs_trusted_workers(tmp_path):
    f = write(tmp_path / "multi.py", MULTI)
    with pytest.raises(ValueError, match=r"its reward turns takes `state`.*trustWorkerRewards"):
        environment.load(f, {"extra": "state"})
    with pytest.raises(ValueError, match=r"its reward <lambda> scores a group of episodes together"):
        environment.load(f, {"extra": "group"})
    with pytest.raises(ValueError, match=r"its rubric has no reward function of weight other than 0"):
        environment.load(f, {"weights": (0.0, 0.0)})
    group = """
        import verifiers as vf
        from datasets import Dataset

        def load_environment():
            ds = Dataset.from_list([{"question": "q", "answer": "a"}])
            return vf.EnvGroup([vf.SingleTurnEnv(dataset=ds), vf.SingleTurnEnv(dataset=ds)], ["x", "y"])
    """
    with pytest.raises(ValueError, match=r"a verifiers EnvGroup is not a MultiTurnEnv"):
        environment.load(write(tmp_path / "group.py", group), {})

    # trusted: a worker scores its own episode, with verifiers' state of it
    turn = environment.turn_caller(f, {"extra": "state"}, trusted=True)
    env = environment.load(f, {"extra": "state"}, trusted=True)
    w = Worker(env, environment.rows(env)[1])
    w.says("2")
    w.says("9")
    w.says("1")
    kind, value = turn(("score", w.messages[:2], w.messages[2:], "2", {"info": {"then": 2}}, w.state))
    assert (kind, value) == ("ok", 1.0 + 0.0 + 3.0)  # first right, second wrong, 3 turns by its state


def test_loading_one_leaves_this_process_s_signals_alone_even_off_the_main_thread(tmp_path):
    """verifiers' Environment sets SIGINT's and SIGTERM's handlers as it is made: not here."""
    f = write(tmp_path / "multi.py", MULTI)
    mine = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        environment.load(f, {})
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        got = []
        t = threading.Thread(target=lambda: got.append(environment.load(f, {})))
        t.start()
        t.join(60)
        assert got and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, mine)


@pytest.mark.e2e  # a fresh interpreter, to see what it imported
def test_an_environment_of_our_own_protocol_does_not_import_verifiers(tmp_path):
    own = write(tmp_path / "own.py", GOOD)
    code = (
        "import sys; from sparrowrl.agents import environment; "
        f"environment.load({own!r}, {{}}); print('verifiers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
