"""Environments (task.environment): loading a user's environment and its refusals, the tokens of
the environment's turns with and without a chat template (one that renders earlier turns
differently included), a worker's episode read back on the trainer (tampering refused), and the
loss that trains sampled tokens only."""

import textwrap

import pytest
import torch

from sparrowrl.agents import environment
from sparrowrl.agents.turns import Turns
from sparrowrl.spec.task import TaskSpec
from sparrowrl.trainer import grpo, models, tasks

EOS = 2
# a chat template whose assistant turns end with EOS, as real ones end with their end-of-turn token
CHAT = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}</s>{% else %}<{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
# ...and one that renders an assistant turn differently once a later turn exists (as Qwen3 drops
# the reasoning of earlier turns): only its first character stays
REWRITES = CHAT.replace(
    "{{ m['content'] }}",
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:1] }}{% else %}{{ m['content'] }}{% endif %}",
)


def tok_with(template=None):
    tok = models.char_tokenizer()
    tok.chat_template = template
    return tok


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_without_a_template_the_environment_s_turn_is_its_text():
    tok = tok_with()
    turns = Turns(tok, templated=False, eos={EOS})
    assert turns.tokens([{"role": "user", "content": "7+2="}], EOS) == ids(tok, "7+2=")
    assert turns.tokens([{"role": "tool", "content": "1"}, {"role": "user", "content": "2"}], EOS) == ids(tok, "1\n2")


@pytest.mark.parametrize("template", [CHAT, REWRITES], ids=["plain", "rewrites-earlier-turns"])
def test_with_a_template_the_turn_is_what_the_template_writes_after_the_model_s_end(template):
    tok = tok_with(template)
    turns = Turns(tok, templated=True, eos={EOS})
    got = turns.tokens([{"role": "user", "content": "9+1="}], EOS)
    assert got == ids(tok, "u:9+1=<a:")  # after the model's </s>: the user's turn and the next generation prompt
    # the episode as a whole reads as the template renders the conversation
    prompt = ids(tok, "u:3+4=<a:")
    first, second = ids(tok, "7") + [EOS], ids(tok, "10") + [EOS]
    episode = {"turns": [{"at": len(first), "tokens": len(got), "messages": [{"role": "user", "content": "9+1="}]}]}
    messages, mask = turns.read(first + got + second, episode)
    assert messages == [
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "9+1="},
        {"role": "assistant", "content": "10"},
    ]
    assert mask == [True] * len(first) + [False] * len(got) + [True] * len(second)
    if template == CHAT:  # the template's own rendering of the whole conversation, token for token
        whole = tok.apply_chat_template(
            [{"role": "user", "content": "3+4="}, *messages[:2]], tokenize=False, add_generation_prompt=True
        )
        assert prompt + first + got == ids(tok, whole)


def test_a_template_that_cannot_end_the_model_s_turn_is_refused():
    tok = tok_with("{% for m in messages %}{{ m['content'] }}<{% endfor %}")  # no </s> after an assistant turn
    with pytest.raises(ValueError, match="does not end an assistant message with '</s>'"):
        Turns(tok, templated=True, eos={EOS}).tokens([{"role": "user", "content": "1"}], EOS)


def _episode(tok, turns):
    first, reply, second = (
        ids(tok, "7") + [EOS],
        turns.tokens([{"role": "user", "content": "7+2="}], EOS),
        ids(tok, "9"),
    )
    return first + reply + second + [EOS], {
        "turns": [{"at": len(first), "tokens": len(reply), "messages": [{"role": "user", "content": "7+2="}]}]
    }


def test_an_episode_whose_tokens_are_not_its_turns_is_refused():
    tok = tok_with()
    turns = Turns(tok, templated=False, eos={EOS})
    tokens, ep = _episode(tok, turns)
    messages, mask = turns.read(tokens, ep)
    assert [m["content"] for m in messages] == ["7", "7+2=", "9"] and mask.count(False) == 4
    forged = dict(ep, turns=[dict(ep["turns"][0], messages=[{"role": "user", "content": "1+1="}])])
    with pytest.raises(ValueError, match="the environment's turn 0: its tokens are not its messages'"):
        turns.read(tokens, forged)  # the worker trained the model on one question, and scores another
    with pytest.raises(ValueError, match="follows a model turn that did not end"):
        turns.read(tokens[:1] + tokens[2:], dict(ep, turns=[dict(ep["turns"][0], at=1)]))
    with pytest.raises(ValueError, match="not after a model turn"):
        turns.read(tokens, dict(ep, turns=[dict(ep["turns"][0], at=0)]))
    with pytest.raises(ValueError, match="ends with the environment's turn"):
        turns.read(tokens[: ep["turns"][0]["at"] + 4], ep)
    # tokens after a turn's end-of-turn token would be trained and never scored
    smuggled = tokens + ids(tok, "66") + [EOS]
    with pytest.raises(ValueError, match="the model's turn 1 goes on after its end-of-turn token"):
        turns.read(smuggled, ep)
    at = ep["turns"][0]["at"]
    early = [tokens[0], EOS, *tokens[1:]]  # "7", EOS, EOS: the first turn goes on past its end
    with pytest.raises(ValueError, match="the model's turn 0 goes on after its end-of-turn token"):
        turns.read(early, dict(ep, turns=[dict(ep["turns"][0], at=at + 1)]))


def test_the_loss_trains_the_sampled_tokens_only():
    """An environment's tokens are context: whatever log-probs a worker reports for them, the
    loss and its gradient are the same."""
    tok = tok_with()
    model = models.tiny_qwen3(len(tok), 32, 1, 2, 0)
    p, c = models.prompt_ids(tok, "3+4="), ids(tok, "7") + [EOS] + ids(tok, "7+2=") + ids(tok, "9") + [EOS]
    mask = [True, True, False, False, False, False, True, True]
    obj = grpo.Objective(temperature=1.0)

    def grads(behaviour):
        model.zero_grad()
        loss, _ = grpo.accumulate(
            model, None, [(p, c, behaviour, mask)], torch.tensor([1.0]), torch.tensor([0.25]), [[0]],
            pad_id=0, objective=obj, device=torch.device("cpu"),
        )  # fmt: skip
        return float(loss), [q.grad.clone() for q in model.parameters()]

    honest = [-1.0] * len(c)
    lying = [x if m else -9000.0 for x, m in zip(honest, mask)]  # far out on the environment's tokens only
    (a, ga), (b, gb) = grads(honest), grads(lying)
    assert a == b and all(torch.equal(x, y) for x, y in zip(ga, gb))
    moved = [x if not m else -5.0 for x, m in zip(honest, mask)]  # the sampled tokens' numbers do count
    assert grads(moved)[0] != a


def write(path, body):
    path.write_text(textwrap.dedent(body))
    return str(path)


GOOD = """
    class Env:
        dataset = [{"prompt": "1+1=", "answer": "2"}]
        def env_response(self, messages, state):
            return []
        def reward(self, prompt, completion, answer, **fields):
            return 1.0
    def load_environment(**args):
        return Env()
"""


def test_an_environment_loads_from_a_file_and_its_faults_are_named(tmp_path):
    env = environment.load(write(tmp_path / "good.py", GOOD), {})
    assert environment.rows(env) == [{"prompt": "1+1=", "answer": "2"}]
    cases = [
        ("", "defines no function load_environment"),
        (
            "def load_environment(**args):\n    raise RuntimeError('no data')\n",
            "load_environment() failed: RuntimeError: no data",
        ),
        ("def load_environment(**args):\n    return object()\n", "the environment has no dataset"),
        ("import not_a_module_here\n", "no module 'not_a_module_here' here"),
        (GOOD.replace("**fields", "state"), "its reward reward takes `state`, which stays on the worker"),
        (GOOD.replace("def reward", "def rewards"), "has no reward and no rubric with functions"),
    ]
    for i, (body, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            environment.load(write(tmp_path / f"bad{i}.py", body), {})
    with pytest.raises(ValueError, match="no file"):
        environment.load(str(tmp_path / "missing.py"), {})


def test_a_verifiers_rubric_is_its_functions_by_weight(tmp_path):
    """verifiers' Rubric: functions, sync or async, each given the arguments it names, summed by weight."""
    body = GOOD.replace(
        "        def reward(self, prompt, completion, answer, **fields):\n            return 1.0\n",
        textwrap.indent(
            textwrap.dedent("""
                class rubric:
                    def right(completion, answer):
                        return float(completion[-1]["content"] == answer)
                    async def short(completion, info, **kwargs):
                        return 1.0 / len(completion) + info["bonus"]
                    funcs, weights = [right, short], [1.0, 0.5]
            """),
            " " * 8,
        ),
    )
    reward = environment.reward_caller(write(tmp_path / "vf.py", body), {})
    completion = [{"role": "assistant", "content": "2"}]
    assert reward([], completion, "2", info={"bonus": 1.0}) == 1.0 + 0.5 * 2.0


def test_the_environment_s_reply_is_checked():
    class Env:
        def __init__(self, out):
            self.out = out

        def env_response(self, messages, state):
            return self.out

    for out, message in [
        ({"role": "user"}, "returned dict, not a list of messages"),
        ([{"role": "assistant", "content": "x"}], "message 0 is not {'role': 'user' or 'tool'"),
        ([{"role": "user", "content": 3}], "message 0 is not"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
            environment.reply(Env(out), [], {})
    assert environment.reply(Env("more"), [], {}) == environment.Turn([{"role": "user", "content": "more"}], False)
    assert environment.reply(Env([]), [], {}) == environment.Turn([], True)


@pytest.mark.parametrize(
    "task, message",
    [
        ({"environment": {"load": "e.py"}, "reward": "exact"}, "an environment brings its own rubric"),
        ({"environment": {"load": "e.py"}, "eval": {"jsonl": "x.jsonl"}}, "an environment's eval examples are its"),
        ({"environment": {"load": "e.py"}, "builtin": "add"}, "give exactly one of"),
        ({"environment": {"load": "a b"}}, "is not an installed module's name"),
        ({"environment": {"load": "e.py", "args": {"x": float("nan")}}}, "not plain JSON values"),
        ({"environment": {"load": "e.py", "maxEpisodeTokens": 100_000}}, "less than or equal to 16384"),
    ],
)
def test_a_bad_environment_spec_is_refused(task, message):
    with pytest.raises(ValueError, match=message):
        TaskSpec.model_validate(task)


def test_stop_strings_are_refused_with_an_environment():
    from support.jobs import job

    from sparrowrl.spec.job import JobError, parse

    with pytest.raises(JobError, match="grpo.stop: an environment's model turns end at the model's end-of-turn"):
        parse(job(task={"environment": {"load": "e.py"}}, grpo={"stop": ["</tool_call>"]}), "j.yaml")


def test_a_reasoning_gym_task_is_an_environment_scored_by_its_own_scorer():
    """reasoning-gym, directly: its data set generated offline, each reply scored by the task's
    score_answer from the row's index (the trainer's processes generate the same data set)."""
    args = {"dataset": "basic_arithmetic", "size": 20, "seed": 3, "config": {"max_terms": 2}}
    env = environment.load("sparrowrl.agents.reasoning_gym", args)
    rows = environment.rows(env)
    assert len(rows) == 20 and rows[4]["prompt"].startswith("Calculate") and rows[4]["info"] == {"index": 4}
    reward = environment.reward_caller("sparrowrl.agents.reasoning_gym", args)  # as a reward process loads it
    right = [{"role": "assistant", "content": f" {rows[4]['answer']} "}]
    wrong = [{"role": "assistant", "content": "no idea"}]
    assert reward([], right, rows[4]["answer"], info={"index": 4}) == 1.0
    assert reward([], wrong, rows[4]["answer"], info={"index": 4}) == 0.0
    tagged = environment.reward_caller("sparrowrl.agents.reasoning_gym", {**args, "answer_tag": "answer"})
    said = [{"role": "assistant", "content": f"thinking... <answer>{rows[4]['answer']}</answer>"}]
    assert tagged([], said, rows[4]["answer"], info={"index": 4}) == 1.0
    assert environment.reply(env, right, {}) == environment.Turn([], True)  # one turn


def test_a_tool_environment_s_prompts_show_its_tools_through_the_chat_template():
    def calc(expression: str) -> str:
        """Evaluate arithmetic.

        Args:
            expression: such as 2*3
        """
        return expression

    def bare(x):
        return x

    class Env:
        tools = [calc]

    schemas = environment.schemas(Env())
    assert schemas[0]["function"]["name"] == "calc"
    assert schemas[0]["function"]["parameters"]["properties"]["expression"]["description"] == "such as 2*3"
    listing = "{% if tools %}t:{% for t in tools %}{{ t['function']['name'] }},{% endfor %}<{% endif %}"
    tok = tok_with(listing + CHAT)
    p = models.Prompts(tok).with_tools(schemas)
    assert p.render(tasks.Source("1+1=", None, "2")).prompt == "t:calc,<u:1+1=<a:"
    assert models.Prompts(tok).render(tasks.Source("1+1=", None, "2")).prompt == "u:1+1=<a:"  # no tools, none shown
    Env.tools = [calc, bare]
    with pytest.raises(ValueError, match="its tool bare: no JSON schema for the chat template to show the model"):
        environment.schemas(Env())


def test_a_worker_s_own_score_passes_state_only_to_a_rubric_that_takes_it():
    def plain(prompt, completion, answer):
        return 0.25

    def stateful(prompt, completion, answer, state, **fields):
        return state["seen"]

    assert environment.score(plain, [], [], "", {}, {"seen": 1.0}) == ("ok", 0.25)
    assert environment.score(stateful, [], [], "", {"state": "a field"}, {"seen": 1.0}) == ("ok", 1.0)
    assert environment.score(lambda *a, **k: float("inf"), [], [], "", {}, {})[0] == "raised"


def test_an_episode_beyond_the_job_s_limits_is_refused_at_the_door():
    from sparrowrl.spec.task import EnvironmentSpec
    from sparrowrl.trainer.control import bad_episode

    env = EnvironmentSpec(load="e.py", max_turns=2)
    turn = {"at": 1, "tokens": 1, "messages": [{"role": "user", "content": "q"}]}
    ok = {"turns": [turn], "end": "done", "seconds": 0.1, "tool_calls": 1, "tool_errors": 1}
    assert bad_episode(ok, env) is None
    assert (
        bad_episode(ok | {"turns": [turn, turn]}, env) == "an episode of 3 model turns (task.environment.maxTurns: 2)"
    )
    assert bad_episode(ok | {"tool_errors": 2}, env) == "an episode of 2 tool errors in 1 calls"
