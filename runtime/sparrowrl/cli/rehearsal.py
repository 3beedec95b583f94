"""One episode of a job's environment against a stub model, before anything runs (`sparrowrl
check`, a trainer pod's init container, and `sparrowrl run`): the environment loads in a process
of its own and takes its turns as it does on a worker, and its rubric scores the transcript as the
trainer's does. The stub answers each turn with the example's answer, then its end-of-turn token."""

from __future__ import annotations

from functools import partial
from typing import cast

from sparrowrl.agents import environment
from sparrowrl.agents.turns import Turns
from sparrowrl.calls import Pool
from sparrowrl.spec.job import JobError, JobSpec
from sparrowrl.trainer import models, rewards
from sparrowrl.trainer.tasks import Task
from sparrowrl.worker.engines import Prompt, Sample, Sampling
from sparrowrl.worker.episodes import Episodes


class Stub:
    def __init__(self, reply: list[int], eos: int):
        self.reply, self.eos = reply, eos

    def generate(self, prompts: list[Prompt], s: Sampling) -> list[list[Sample]]:
        tokens = self.reply[: s.max_new_tokens - 1] + [self.eos]
        return [[Sample(tokens, [0.0] * len(tokens), "eos") for _ in range(s.n)] for _ in prompts]


def rehearse(spec: JobSpec, task: Task, job: str) -> str:
    """One episode of the task's first example, scored; JobError where it fails."""
    env = spec.task.environment
    assert env is not None  # an environment's job
    where = f"{job}: spec.task.environment"
    tok = models.tokenizer(spec)
    prompts = models.Prompts.for_job(spec, tok)
    if tok.eos_token_id is None:
        raise JobError(f"{where}: the tokenizer has no end-of-sequence token to end a model's turn with")
    ex = task.example(0)
    stub = Stub(tok(ex.answer, add_special_tokens=False).input_ids, tok.eos_token_id)
    turns = Turns(tok, prompts.templated, {tok.eos_token_id})
    tool = environment.ToolLimits.of(env)
    load = partial(environment.turn_caller, env.load, env.args, tool, env.trust_worker_rewards)
    pool = Pool(load, 1, env.turn_seconds, "environment")
    try:
        [[result]] = Episodes(stub, turns, env, pool).run(
            [Prompt(prompts.ids(ex.prompt), 0)],
            [ex.shown()],
            Sampling(n=1, max_new_tokens=spec.grpo.max_new_tokens, temperature=1.0),
        )
    finally:
        pool.close()
    episode = result["episode"]
    if episode["end"] == "error":
        raise JobError(f"{where}: one episode against a stub model failed: {episode['reason']}")
    try:
        messages, _ = turns.read(result["tokens"], episode)
    except ValueError as e:
        raise JobError(f"{where}: one episode against a stub model does not read back: {e}") from None
    if env.trust_worker_rewards:  # scored as a worker scores it
        if "reward" not in episode:
            raise JobError(f"{where}: its rubric failed on one episode against a stub model: {episode['reason']}")
        reward = episode["reward"]
    else:  # as the trainer's reward processes score it: in a process of its own, within its timeout
        prompt = [{"role": r, "content": c} for r, c in ex.messages]
        rubric = Pool(
            partial(rewards.judged, partial(environment.reward_caller, env.load, env.args)),
            1,
            spec.task.reward_timeout_seconds,
            "reward",
        )
        try:
            [(kind, value)] = rubric.run([(prompt, messages, ex.answer, ex.fields)])
        finally:
            rubric.close()
        if kind != "ok":
            raise JobError(f"{where}: its rubric failed on one episode against a stub model ({kind}): {value}")
        reward = float(cast(float, value))
    return (
        f"one episode against a stub model (it answers with the example's answer): {len(episode['turns']) + 1} "
        f"model turns, {episode['tool_calls']} tool calls, ended {episode['end']}, reward {reward:g}"
    )
