"""The trainer's control plane: what workers ask of it over HTTP. Thin handlers over the
coordinator's decisions (coordinator.py):

    GET  /v1/job, /v1/model[/NAME]   what a worker builds its engine from
    POST /v1/work                    a lease, a version to reach first, wait, or done
    POST /v1/results                 a lease's samples, admitted or refused
    POST /v1/commit                  the version a worker now holds and its hash, checked

Each handler parses, calls the coordinator once, journals, answers; the coordinator holds the
job's state. In a job of many workers, those waiting for work wake only when work may have come
(`Coordinator.moves`), not at every commit or result: a thousand long polls do not all run again
at each of a thousand requests. An answer's `Server-Timing: wait;dur=MS` header says how long it waited on purpose
(a long poll for work, a commit ahead of the store), so that a client can tell the trainer's own
latency from the wait it asked for. Each POST acts once per idempotency key (`idempotent`). Every change to the
coordinator goes through `changed`: the trainer journals it before the request is answered, and
whoever waits for it wakes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from sparrowrl.auth.tokens import acts_as
from sparrowrl.rollout.coordinator import Coordinator
from sparrowrl.rollout.evals import Evals
from sparrowrl.spec import messages
from sparrowrl.spec.job import JobSpec
from sparrowrl.spec.task import EnvironmentSpec
from sparrowrl.trainer.learner import Learner
from sparrowrl.trainer.tasks import HELD_OUT
from sparrowrl.transport.http import PRINCIPAL

log = logging.getLogger(__name__)

LOOK = random.Random()  # when each long poll for work looks again (see `h_work`)
MAX_WORKERS = 1 << 16  # distinct worker names the trainer keeps track of (a job has 4096 at most at once;
# replaced pods come back under new names)


def group_seed(job_seed: int, group: int) -> int:
    """Sampling is seeded per prompt group, so a group's samples depend only on the weights."""
    return (job_seed * 1_000_003 + group) % 2**63


def idempotent(model: type[messages.Body]):
    """A control POST whose body is a valid `model` acts once per idempotency key
    (`Client.post_json` sends the same key on every retry). A retry after a lost answer, or
    while the first is still being answered, gets the first answer: not a second lease, a
    second admission or a second commit. A malformed body is a 400 naming the field; malformed
    results whose lease can be read refuse that lease, whose groups go back to the queue. A
    worker's token acts under its own name only (403)."""

    def wrap(handler):
        @functools.wraps(handler)
        async def answer(self: Control, request: web.Request) -> web.Response:
            raw, who = None, request[PRINCIPAL]

            def as_who(worker: str) -> None:
                if not acts_as(who, worker):
                    raise web.HTTPForbidden(
                        text=f"{request.path}: this token is worker {who.name!r}'s, not {worker!r}'s"
                    )

            try:
                raw = await request.json()
                body = messages.parse(model, raw).model_dump()
            except (ValueError, RecursionError) as e:  # ValueError: also a body that is not JSON
                reason = f"{request.path}: {e if isinstance(e, ValueError) else 'JSON nested too deeply'}"
                if model is messages.Results and (lease := _lease_of(raw)):
                    as_who(lease.worker)  # another worker's lease is not this token's to refuse
                    self.coord.refuse(lease.lease, lease.worker)
                    self.changed()
                    return web.json_response({"admitted": 0, "refused": reason})
                raise web.HTTPBadRequest(text=reason) from None
            as_who(body["worker"])
            if not self.coord.fleet.knows(body["worker"]) and self.coord.fleet.heard_from >= MAX_WORKERS:
                raise web.HTTPServiceUnavailable(
                    text=f"{request.path}: the trainer tracks {MAX_WORKERS} workers "
                    f"already; {body['worker']!r} is not one of them"
                )
            key = request.headers.get("Idempotency-Key")
            slot = (request.path, body["worker"])  # each worker's latest request per route
            last = self.answers.get(slot)
            if key is None or last is None or last[0] != key:
                last = self.answers[slot] = (key, asyncio.ensure_future(handler(self, body)))
            answer, waited = await asyncio.shield(last[1])  # a dropped connection does not cancel it
            return web.json_response(answer, headers={"Server-Timing": f"wait;dur={waited * 1000:.1f}"})

        return answer

    return wrap


async def _wait(event: asyncio.Event, seconds: float) -> float:
    """Until `event` is set or `seconds` pass; the seconds it waited. A timeout scope, not
    `wait_for`'s task per waiter: a thousand waiters wake at once, each in fewer steps."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(max(0.0, seconds)):
            await event.wait()
    except TimeoutError:
        pass
    return time.monotonic() - t0


def bad_episode(ep: dict, env: EnvironmentSpec) -> str | None:
    """An episode's claims that its job's limits rule out."""
    if len(ep["turns"]) >= env.max_turns:
        return f"an episode of {len(ep['turns']) + 1} model turns (task.environment.maxTurns: {env.max_turns})"
    if ep["tool_errors"] > ep["tool_calls"]:
        return f"an episode of {ep['tool_errors']} tool errors in {ep['tool_calls']} calls"
    return None


def _for_workers(env: EnvironmentSpec | None) -> EnvironmentSpec | None:
    """task.environment as workers load it: a file under this process's working folder named
    relative to it, as a worker finds it under its own (every job pod's is /var/lib/sparrowrl,
    where the job's volumes are mounted; `sparrowrl run`'s processes share one)."""
    if env is None or not env.load.endswith(".py"):
        return env
    try:
        return env.model_copy(update={"load": str(Path(env.load).relative_to(Path.cwd()))})
    except ValueError:  # elsewhere: by its absolute path
        return env


def _lease_of(raw: object) -> messages.LeaseOf | None:
    try:
        return messages.LeaseOf.model_validate(raw, strict=False) if isinstance(raw, dict) else None
    except ValueError:
        return None


class Control:
    """The routes workers call. `journal(admitted)` records a change to the coordinator (with
    the (batch, groups) just admitted) before it is answered."""

    def __init__(
        self,
        spec: JobSpec,
        learner: Learner,
        coord: Coordinator,
        journal: Callable[[tuple[int, list[int]] | None], None],
        evals: Evals | None = None,
    ):
        self.spec, self.learner, self.coord, self.journal = spec, learner, coord, journal
        self.evals = evals  # task.eval's rounds: leased before training work, never journaled
        self.answers: dict[tuple[str, str], tuple[str | None, asyncio.Future]] = {}  # see `idempotent`
        self._changed = asyncio.Event()
        self._work, self._moves = asyncio.Event(), coord.moves  # see `until_work`

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/job", self.h_job),
            web.get("/v1/model", self.h_model),
            web.get(r"/v1/model/{name:[A-Za-z0-9][-A-Za-z0-9_.]{0,127}}", self.h_model_file),
            web.post("/v1/work", self.h_work),
            web.post("/v1/results", self.h_results),
            web.post("/v1/commit", self.h_commit),
        ]

    # ---- one way to wait for a change ----
    def changed(self, admitted: tuple[int, list[int]] | None = None) -> None:
        """The coordinator's state changed: journal it, then wake whoever waits for a change."""
        self.journal(admitted)
        self.wake()
        if self.coord.moves != self._moves or not self.coord.fleet.many:  # a small job's waiters wake at every change
            self._moves = self.coord.moves
            self._work.set()
            self._work = asyncio.Event()

    def wake(self) -> None:
        """Wake whoever waits for a change, with nothing to journal (an eval round's results)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def until_changed(self, seconds: float) -> float:
        """Until the coordinator's state changes (a publish, a result, a commit), or `seconds`;
        the seconds it waited."""
        return await _wait(self._changed, seconds)

    async def until_work(self, seconds: float) -> float:
        """Until work may have come for a worker told to wait (a publish, groups back in the
        queue, rollouts started), or `seconds`; the seconds it waited."""
        return await _wait(self._work, seconds)

    # ---- the routes ----
    async def h_job(self, request: web.Request) -> web.Response:
        g, r = self.spec.grpo, self.spec.rollout
        return web.json_response(
            messages.Job(
                group_size=g.group_size,
                temperature=g.temperature,
                top_p=g.top_p,
                top_k=g.top_k,
                stop=g.stop,
                max_new_tokens=g.max_new_tokens,
                max_model_len=r.max_model_len,
                tensor_parallel_size=r.tensor_parallel_size,
                mode=self.spec.sync.mode,
                engine=r.engine,
                streams=self.spec.sync.streams,
                environment=_for_workers(self.spec.task.environment),
                templated=self.learner.prompts.templated,
            ).model_dump()
        )

    async def h_model(self, request: web.Request) -> web.Response:
        """The files a worker builds its engine from (the config and the tokenizer, no weights:
        those come from the store), with their sizes and sha256: workers need no shared disk."""
        return web.json_response({"files": self.learner.model_files})

    async def h_model_file(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in {f["name"] for f in self.learner.model_files}:
            raise web.HTTPNotFound(text=f"no model file {name!r}")
        return web.FileResponse(self.learner.model_dir / name)

    @idempotent(messages.Work)
    async def h_work(self, body: dict) -> tuple[dict, float]:
        if self.evals is not None and (lease := self.evals.work(body["worker"], body["version"])) is not None:
            e = self.spec.task.eval
            assert e is not None  # eval rounds are task.eval's
            lease["prompts"] = [
                {
                    "group": i,
                    "ids": self.learner.eval_ids(i),
                    "seed": group_seed(self.spec.seed, HELD_OUT + i),
                    **({"example": self.learner.held_out[i].shown()} if self.spec.task.environment else {}),
                }
                for i in lease.pop("prompts")
            ]
            lease["eval"] = {"samples": e.samples, "greedy": e.decoding == "greedy"}
            return {"lease": lease}, 0.0
        deadline, waited = time.monotonic() + 10, 0.0  # a long poll: wait here for work rather than be asked again
        while True:
            ans = self.coord.work(body["worker"], body["version"], body["region"])
            if "wait" not in ans or time.monotonic() > deadline:
                break
            # and about once a second, each waiter at its own time: a lost worker's share frees up,
            # a complete batch (not a move) is learnt of, and a herd woken at once does not look
            # again at once
            waited += await self.until_work(LOOK.uniform(0.5, 1.5))
        if "lease" in ans:
            self.changed()  # journaled before it is answered: a restarted trainer knows the lease
            ans["lease"]["prompts"] = [
                {
                    "group": g,
                    "ids": self.learner.prompt_ids(g),
                    "seed": group_seed(self.spec.seed, g),
                    **({"example": self.learner.prompt(g).shown()} if self.spec.task.environment else {}),
                }
                for g in ans["lease"]["groups"]
            ]
        return ans, waited

    @idempotent(messages.Results)
    async def h_results(self, body: dict) -> tuple[dict, float]:
        results = body["results"]
        if self.evals is not None and self.evals.is_lease(body["lease"]):
            return self._eval_results(body), 0.0
        if bad := self._malformed(results):
            self.coord.refuse(body["lease"], body["worker"])
            self.changed()
            return {"admitted": 0, "refused": bad}, 0.0
        ans = self.coord.submit(
            body["lease"], body["worker"], body["version"], body["state_hash"], results, body["generate_s"]
        )
        self.changed((ans["batch"], ans.pop("groups")) if ans["admitted"] else None)  # admitted: journaled first
        return ans, 0.0

    def _eval_results(self, body: dict) -> dict:
        """An eval lease's samples: checked as training results are, then kept for scoring."""
        e = self.spec.task.eval
        assert e is not None and self.evals is not None  # an eval lease is task.eval's
        if self.coord.hash_of(body["version"]) != body["state_hash"]:
            ans = {
                "admitted": 0,
                "refused": f"state hash {body['state_hash'][:16]} is not the trainer's v{body['version']}",
            }
        elif bad := self._malformed(body["results"], e.samples):
            ans = {"admitted": 0, "refused": bad}
        else:
            ans = self.evals.submit(body["lease"], body["worker"], body["version"], body["results"])
        self.wake()  # the training loop scores a round once it is complete
        return ans

    def _malformed(self, results: dict[int, dict], per_group: int | None = None) -> str | None:
        """Workers are not trusted: a result that would break the training step is refused."""
        g, vocab, env = self.spec.grpo, len(self.learner.tok), self.spec.task.environment
        n = per_group or g.group_size
        most = env.max_episode_tokens if env else g.max_new_tokens
        for group, r in results.items():
            samples = r["samples"]
            if len(samples) != n:
                what = "the job's group size" if per_group is None else "task.eval.samples"
                return f"group {group}: {len(samples)} samples, {what} is {n}"
            for x in samples:
                t, lp = x["tokens"], x["logprobs"]
                if not 1 <= len(t) <= most or len(t) != len(lp):
                    return f"group {group}: {len(t)} tokens with {len(lp)} log-probs (1..{most} tokens)"
                if (x.get("episode") is None) != (env is None):
                    return f"group {group}: a sample {'without' if env else 'with'} an episode (task.environment)"
                if env is not None and (bad := bad_episode(x["episode"], env)):
                    return f"group {group}: {bad}"
                if not all(0 <= i < vocab for i in t):
                    return f"group {group}: a token id outside the vocabulary (0..{vocab - 1})"
        return None

    @idempotent(messages.Commit)
    async def h_commit(self, body: dict) -> tuple[dict, float]:
        self.coord.heard(body["worker"])
        deadline, waited = time.monotonic() + 30, 0.0
        while body["version"] > self.coord.published and time.monotonic() < deadline:
            # a worker can hold a delta before the trainer has finished storing it
            waited += await self.until_changed(1.0)
        more_refused = body["refused"] > self.coord.fleet.refused_by(body["worker"])
        ok = self.coord.commit(
            body["worker"], body["version"], body["state_hash"], body.get("fetch_s"), body["refused"]
        )
        if more_refused:
            log.warning(
                f"trainer: worker {body['worker']} has refused {body['refused']} answers from its servers "
                f"(its log names them)"
            )
        self.changed()
        return {"verified": ok}, waited
