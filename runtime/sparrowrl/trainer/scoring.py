"""How the learner reads its samples: each group's prompt, rewards with overlong shaping, why a
completion ended (from its tokens, not the worker's word), an episode's turns (task.environment:
its messages, rendered and checked here, and the tokens to train), and eval rounds scored. A base
of `Learner`, whose __init__ sets the attributes it reads."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from sparrowrl.agents.turns import Turns
from sparrowrl.rollout import evals
from sparrowrl.rollout.coordinator import Batch
from sparrowrl.spec.job import JobSpec
from sparrowrl.trainer import models, rewards, tasks


class Scoring:
    spec: JobSpec
    tok: PreTrainedTokenizerBase
    prompts: models.Prompts
    task: tasks.Task
    held_out: list[tasks.Example]  # task.eval's examples; rank 0's only
    scorer: rewards.Scorer | None  # rank 0's only
    eos: set[int]
    turns: Turns | None  # task.environment's: an episode's tokens read as messages

    LIMITS = ("max_turns", "max_tokens", "length", "timeout")  # an episode that ended at one is truncated

    def read(self, samples: list[list[dict]]) -> tuple[list[list[str]], list[list[list[bool] | None]], set, set]:
        """Each sample as the trainer reads it: why its (last) model turn ended, from its tokens;
        which of its tokens were sampled (None: all of them); the (group, sample) of episodes that
        ended at a limit; and of those whose tokens are not their turns (refused, never trained)."""
        ends = [[self._finish(s["tokens"]) for s in group] for group in samples]
        masks: list[list[list[bool] | None]] = [[None] * len(group) for group in samples]
        limit, unread = set(), set()
        if self.turns is not None:
            for i, group in enumerate(samples):
                for j, s in enumerate(group):
                    read = self.episode(s)
                    if isinstance(read, str):
                        unread.add((i, j))
                        masks[i][j] = [False] * len(s["tokens"])
                    else:
                        masks[i][j] = read[1]
                    if s["episode"]["end"] in self.LIMITS:
                        limit.add((i, j))
        return ends, masks, limit, unread

    def episode(self, s: dict) -> tuple[list[dict[str, str]], list[bool]] | str:
        """An episode's messages after its prompt, and which of its tokens the model sampled; or
        why its tokens do not read as its turns."""
        assert self.turns is not None  # task.environment's
        try:
            return self.turns.read(s["tokens"], s["episode"])
        except ValueError as e:
            return str(e)

    def prompt(self, group: int) -> tasks.Example:
        return self.task.example(group)

    def eval_ids(self, i: int) -> list[int]:
        """Eval prompt `i` as token ids: what an eval lease carries."""
        return self.prompts.ids(self.held_out[i].prompt)

    def evaluate(self, version: int, results: dict[int, dict]) -> dict:
        """An eval round's row: its samples scored with the job's reward (rank 0's scorer), pass@1
        (the share of samples that score 1) and, with several samples per prompt, pass@k for k
        of them."""
        e = self.spec.task.eval
        assert e is not None and self.scorer is not None  # eval rounds are task.eval's, scored on rank 0
        flat, failed = self._scored([(self.held_out[i], res["samples"]) for i, res in sorted(results.items())])
        n = e.samples
        correct = [sum(r >= 1.0 for r in flat[i : i + n]) for i in range(0, len(flat), n)]
        row = {
            "version": version,
            "prompts": len(correct),
            "samples": n,
            "decoding": e.decoding,
            "pass_at_1": sum(c / n for c in correct) / len(correct),
            "reward_mean": sum(flat) / len(flat),
            "reward_failed": failed,
        }
        if n > 1:
            row["pass_at_k"] = sum(evals.pass_at(n, c, n) for c in correct) / len(correct)
        return row

    def prompt_ids(self, group: int) -> list[int]:
        """The group's prompt as token ids: what its lease carries, and what the step scores."""
        return self.prompts.ids(self.prompt(group).prompt)

    def _score(self, batch: Batch) -> tuple[list[list[float]], dict[str, int]]:
        """The rewards of the batch's samples by group, and the failures by kind. Groups scored as
        they were admitted (refills on) keep those rewards; the others are scored in one call (a
        user's reward runs them in parallel)."""
        todo = [g for g in batch.groups if g not in batch.scores]
        fresh, failed = self._rewards({g: batch.results[g] for g in todo}) if todo else ({}, {})
        for g in batch.groups:
            if g in batch.scores:
                failed = {k: failed.get(k, 0) + n for k, n in batch.scores[g][1].items()}
        return [batch.scores[g][0] if g in batch.scores else fresh[g] for g in batch.groups], failed

    def _rewards(self, results: dict[int, dict]) -> tuple[dict[int, list[float]], dict[str, int]]:
        """Groups' samples scored in one call: each group's rewards, and the failures by kind. An
        episode is scored from its messages; one that failed on its worker, or whose tokens are
        not its turns, scores 0.0 unscored."""
        flat, failed = self._scored([(self.prompt(g), res["samples"]) for g, res in results.items()])
        n = self.spec.grpo.group_size
        return {g: flat[i * n : (i + 1) * n] for i, g in enumerate(results)}, failed

    def _scored(self, groups: list[tuple[tasks.Example, list[dict]]]) -> tuple[list[float], dict[str, int]]:
        """Each sample's reward, in order, and the failures by kind."""
        items: list[rewards.Item | None] = []
        for ex, samples in groups:
            prompt = [{"role": r, "content": c} for r, c in ex.messages]
            for s in samples:
                if self.turns is None:
                    items.append((ex.prompt, models.completion_text(self.tok, s["tokens"]), ex.answer, ex.fields))
                    continue
                read = self.episode(s)
                ok = not isinstance(read, str) and s["episode"]["end"] != "error"
                items.append((prompt, read[0], ex.answer, ex.fields) if ok else None)
        assert self.scorer is not None  # rank 0 scores
        env = self.spec.task.environment
        if env is not None and env.trust_worker_rewards:  # the workers' own scores, unchecked
            own = [s["episode"].get("reward") for _, samples in groups for s in samples]
            failed = dict.fromkeys(rewards.FAILURES, 0)
            failed["raised"] = sum(r is None and x is not None for r, x in zip(own, items))
            return [r if r is not None and x is not None else 0.0 for r, x in zip(own, items)], failed
        scored, failed = self.scorer.score([x for x in items if x is not None])
        it = iter(scored)
        return [next(it) if x is not None else 0.0 for x in items], failed

    def score(self, results: dict[int, dict]) -> dict[int, tuple[list[float], dict[str, int], bool]]:
        """Admitted groups scored as they come (refills on): each one's rewards, its failures by
        kind, and whether its shaped rewards vary (a group that does not teaches nothing)."""
        out = {}
        for g, res in results.items():  # a call each: failures are counted per group
            rewards, failed = self._rewards({g: res})
            shaped = self._shaped(rewards[g], res["samples"])
            out[g] = (rewards[g], failed, max(shaped) != min(shaped))
        return out

    def _shaped(self, rewards: list[float], samples: list[dict]) -> list[float]:
        """A group's rewards after overlong shaping (not of episodes: grpo.maxNewTokens bounds
        their turns, not them): what its advantages are taken from."""
        if self.turns is not None:
            return list(rewards)
        return [r + self._overlong(len(s["tokens"])) for r, s in zip(rewards, samples, strict=True)]

    def _finish(self, tokens: list[int]) -> str:
        """Why a completion ended, read from its tokens as the engines end them (engines.FINISH)."""
        if tokens[-1] in self.eos:
            return "eos"
        stop = self.spec.grpo.stop
        if stop and any(x in models.completion_text(self.tok, tokens) for x in stop):
            return "stop"
        return "length"

    def _overlong(self, length: int) -> float:
        """DAPO's overlong shaping: what a completion of `length` tokens loses of its reward."""
        g = self.spec.grpo
        over = length - (g.max_new_tokens - g.overlong_buffer)
        return -g.overlong_penalty * over / g.overlong_buffer if g.overlong_buffer and over > 0 else 0.0
