"""The trainer: fp32 master weights and AdamW, GRPO on admitted rollouts, and after every step the
bf16 policy's delta streamed into the checkpoint store, where the server publishes it as it is
written (cut-through). Its HTTP server also carries the coordinator's routes."""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import json
import time
from pathlib import Path

import torch
from aiohttp import web

from sparrowrl import grpo, messages, models, resume, tasks
from sparrowrl.coordinator import Batch, Coordinator
from sparrowrl.delta import state_hash
from sparrowrl.delta.frame import TensorSpec
from sparrowrl.job import JobSpec
from sparrowrl.metrics import add_metrics, family
from sparrowrl.status import JobStatus, WorkerStatus
from sparrowrl.store import Store
from sparrowrl.transport.server import SERVED, add_health, listen, make_app


def make_task(spec: JobSpec) -> tuple[tasks.Task, tasks.Reward]:
    t = spec.task
    task = tasks.BUILTIN[t.builtin](spec.seed) if t.builtin else tasks.Jsonl(spec.seed, t.jsonl)
    return task, tasks.reward_function(t.reward or task.default_reward)


def warm_up(model: torch.nn.Module, tok, task: tasks.Task, steps: int, batch: int = 64, lr: float = 3e-3) -> None:
    """Stand in for pretraining: teach a model made from scratch the task's answers, but let half
    of them run on (`7` as `7=7`), so that it knows the answers and often fails to stop, the kind
    of habit RL post-training removes."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for s in range(steps):
        exs = [task.example(10**9 + s * batch + i) for i in range(batch)]  # far beyond any RL prompt
        answers = [e.answer if i % 2 else f"{e.answer}={e.answer}" for i, e in enumerate(exs)]
        ids = [models.prompt_ids(tok, e.prompt) + tok(a, add_special_tokens=False).input_ids + [tok.eos_token_id]
               for e, a in zip(exs, answers)]
        n = max(map(len, ids))
        x = torch.tensor([i + [tok.pad_token_id] * (n - len(i)) for i in ids])
        labels = torch.tensor([i + [-100] * (n - len(i)) for i in ids])
        loss = model(input_ids=x, attention_mask=(labels != -100).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def group_seed(job_seed: int, group: int) -> int:
    """Sampling is seeded per prompt group, so a group's samples depend only on the weights."""
    return (job_seed * 1_000_003 + group) % 2**63


class Trainer:
    """The model, its optimizer and the store. Started on a state dir that holds a checkpoint, it
    goes on from there (see resume.py): `version` is the newest version it has trained."""

    def __init__(self, spec: JobSpec, state_dir: Path):
        self.spec, self.state_dir = spec, state_dir
        resumed = resume.claim(state_dir, spec.model_dump(mode="json"))
        torch.manual_seed(spec.seed)
        if spec.model.tiny:
            self.tok = models.char_tokenizer()
            t = spec.model.tiny
            self.model = models.tiny_qwen3(len(self.tok), t.hidden, t.layers, t.heads, spec.seed)
        else:
            self.model, self.tok = models.load(spec.model.path, spec.model.tokenizer)
        self.task, self.reward = make_task(spec)
        g = spec.grpo
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
        self.saved = resume.Checkpoints(state_dir / "trainer")
        newest = self.saved.newest() if resumed else None
        if newest is None:
            if spec.model.tiny and spec.model.tiny.warmup_steps:
                warm_up(self.model, self.tok, self.task, spec.model.tiny.warmup_steps)
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if g.kl_coef > 0 else None
            if self.ref is not None:
                self.saved.save_ref(self.ref)
            self.version, self.row = 0, None
            self.saved.save(0, self.model, self.opt, None)
        else:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if g.kl_coef > 0 else None
            if self.ref is not None:
                self.saved.load_ref(self.ref)
            self.version = newest
            self.row = self.saved.load(newest, self.model, self.opt)  # the step's metrics before it published
        self.model.train()
        self.policy = models.policy_state(self.model)
        self.dense_bytes = sum(t.numel() * t.element_size() for t in self.policy.values())
        # workers build the architecture from this folder; the weights come from the store
        self.model_dir = state_dir / "model"
        self.model.config.save_pretrained(self.model_dir)
        self.tok.save_pretrained(self.model_dir)
        self.model_files = [{"name": f.name, "bytes": f.stat().st_size,
                             "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                            for f in sorted(self.model_dir.iterdir()) if f.is_file()]
        self.store, self.extract_s = self._open_store()

    def _open_store(self) -> tuple[Store, float | None]:
        """The store, brought to the checkpoint's version: a trainer killed between its checkpoint
        and its publish publishes now, from the same weights, so the same bytes (the seconds it
        took are returned). The store is never ahead of the checkpoint."""
        path = self.state_dir / "store"
        if not (path / "store.json").exists():
            if self.version:
                raise resume.ResumeError(f"{path}: missing, and the checkpoint is at v{self.version}")
            every = 1 if self.spec.sync.mode == "full" else self.spec.sync.base_every
            return Store.init(path, self.policy, base_every=every), None
        store = Store(path)
        store.drop_partial()  # the delta a killed trainer was writing: written again below, or next step
        t0, extract_s = time.perf_counter(), None
        if store.newest == self.version - 1:
            old = store.materialize(store.newest)
            self.policy, new = old, self.policy
            self.publish_state(store, new)
            extract_s = time.perf_counter() - t0
        if store.newest != self.version or store.versions[store.newest].state_hash != state_hash(self.policy):
            raise resume.ResumeError(f"{path}: its newest version v{store.newest} is not the checkpoint's "
                                     f"v{self.version}")
        if store.base_due(self.version) and not store.versions[self.version].base:
            store.snapshot(self.version, self.policy)  # killed before its snapshot
        return store, extract_s

    def prompt(self, group: int) -> tasks.Example:
        return self.task.example(group)

    def train(self, batch: Batch) -> dict:
        """One optimizer step on a complete batch; returns its metrics."""
        g = self.spec.grpo
        t0 = time.perf_counter()
        rows, rewards, tokens = [], [], 0
        for group in batch.groups:
            ex, res = self.prompt(group), batch.results[group]
            p = models.prompt_ids(self.tok, ex.prompt)
            rs = [self.reward(ex.prompt, models.completion_text(self.tok, s["tokens"]), ex.answer) for s in res["samples"]]
            rewards.append(rs)
            for s in res["samples"]:
                rows.append((p, s["tokens"], s["logprobs"]))
                tokens += len(s["tokens"])
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = grpo.advantages(r).flatten()
        ids, attention, positions, mask, behaviour = _pad(rows, self.tok.pad_token_id)
        n_prompt = max(len(p) for p, _, _ in rows)
        logp = grpo.token_logprobs(self.model, ids, attention, n_prompt, g.temperature, positions)
        ref = None
        if self.ref is not None:
            with torch.no_grad():
                ref = grpo.token_logprobs(self.ref, ids, attention, n_prompt, g.temperature, positions)
        loss, stats = grpo.loss(logp, behaviour, adv, mask, g.clip, ref, g.kl_coef)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.max_grad_norm))
        self.opt.step()
        return {"reward_mean": float(r.mean()), "reward_exact": float((r == 1).float().mean()), "loss": float(loss.detach()),
                "grad_norm": grad_norm, "tokens": tokens, "train_s": time.perf_counter() - t0, **stats,
                "behaviour_versions": sorted({res["version"] for res in batch.results.values()})}

    def checkpoint(self, row: dict) -> None:
        """After a step, before its publish: the store is never ahead of the checkpoint."""
        self.version += 1
        self.saved.save(self.version, self.model, self.opt, row)

    def publish(self) -> float:
        """Stream the new bf16 policy's delta into the store (served as it is written); returns
        the seconds it took."""
        t0 = time.perf_counter()
        self.publish_state(self.store, models.policy_state(self.model))
        return time.perf_counter() - t0

    def publish_state(self, store: Store, new: dict[str, torch.Tensor]) -> None:
        with store.publish([TensorSpec.of(n, t) for n, t in new.items()]) as w:
            w.add((n, self.policy[n], new[n]) for n in new)
        if store.base_due(store.newest):
            store.snapshot(store.newest, new)
        self.policy = new

    def published(self, version: int) -> dict:
        """What version `version` shipped, from the store's index."""
        v = self.store.versions[version]
        return {"version": version, "state_hash": v.state_hash,
                "changed_fraction": v.changed / sum(t.numel() for t in self.policy.values()),
                "payload_bytes": v.base_bytes if self.spec.sync.mode == "full" else v.delta_bytes,
                "dense_bytes": self.dense_bytes}

    def save(self, out: Path) -> None:
        self.model.save_pretrained(out)
        self.tok.save_pretrained(out)


def _pad(rows, pad: int):
    """Left-pad prompts, right-pad completions: prompts end at one column, so completion token j
    sits at the same position in every row."""
    n_prompt = max(len(p) for p, _, _ in rows)
    n_comp = max(len(c) for _, c, _ in rows)
    ids = torch.full((len(rows), n_prompt + n_comp), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros(len(rows), n_comp)
    behaviour = torch.zeros(len(rows), n_comp)
    for i, (p, c, lp) in enumerate(rows):
        ids[i, n_prompt - len(p):n_prompt] = torch.tensor(p)
        ids[i, n_prompt:n_prompt + len(c)] = torch.tensor(c, dtype=torch.long)
        attention[i, n_prompt - len(p):n_prompt + len(c)] = 1
        mask[i, :len(c)] = 1
        behaviour[i, :len(c)] = torch.tensor(lp)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return ids, attention, positions, mask, behaviour


# ---------------------------------------------------------------- the trainer process

def once(model: type[messages.Body]):
    """A control POST whose body is a valid `model` acts once per idempotency key
    (`Client.post_json` sends the same key on every retry). A retry after a lost answer, or
    while the first is still being answered, gets the first answer: not a second lease, a
    second admission or a second commit. A malformed body is a 400 naming the field; malformed
    results whose lease can be read refuse that lease, whose groups go back to the queue."""

    def wrap(handler):
        @functools.wraps(handler)
        async def answer(self: "Run", request: web.Request) -> web.Response:
            raw = None
            try:
                raw = await request.json()
                body = messages.parse(model, raw).model_dump()
            except (ValueError, RecursionError) as e:  # ValueError: also a body that is not JSON
                reason = f"{request.path}: {e if isinstance(e, ValueError) else 'JSON nested too deeply'}"
                if model is messages.Results and (lease := self._lease_of(raw)):
                    self.coord.refuse(lease.lease, lease.worker)
                    self._touch()
                    return web.json_response({"admitted": 0, "refused": reason})
                raise web.HTTPBadRequest(text=reason) from None
            key = request.headers.get("Idempotency-Key")
            slot = (request.path, body["worker"])  # each worker's latest request per route
            last = self.answers.get(slot)
            if key is None or last is None or last[0] != key:
                last = self.answers[slot] = (key, asyncio.ensure_future(handler(self, body)))
            return web.json_response(await asyncio.shield(last[1]))  # a dropped connection does not cancel it

        return answer

    return wrap


class Run:
    """The trainer process: store server + coordinator routes + the training loop."""

    def __init__(self, spec: JobSpec, state_dir: Path, token: str):
        self.spec, self.state_dir, self.token = spec, state_dir, token
        self.trainer = Trainer(spec, state_dir)
        s = spec.rollout
        self.coord = Coordinator(spec.grpo.prompts_per_step, s.groups_per_lease, s.lease_seconds, spec.sync.staleness,
                                 spec.steps)
        for v, entry in self.trainer.store.versions.items():
            self.coord.publish(v, entry.state_hash)
        self.fetch: dict[int, dict[str, float]] = {}  # version → worker → seconds to stage it
        self.gen: dict[int, float] = {}  # batch → worker-seconds generating it
        self.seen: dict[str, float] = {}  # worker → when it last called
        self.regions: dict[str, str] = {}  # worker → the region it says it is in
        self.first: dict[str, int] = {}  # worker → the first version it committed
        self.answers: dict[tuple[str, str], tuple[str | None, asyncio.Future]] = {}  # see `once`
        self.changed = asyncio.Event()
        self.t_start = time.time()
        self.finished = False
        self.begun = False  # rollouts have started (see `_started`)
        self.restarts = 0  # trainer processes before this one, on this state dir
        self.seconds_before = 0.0  # the training loop's time in those processes
        self.sent = {"delta": 0, "base": 0}  # what crossed from the origin: to relays, and to workers without one
        self.t_loop: float | None = None  # when this process's training loop started
        self.rows = self._written_rows()  # version → metrics row, written once its transfer is known
        self.written = max(self.rows, default=0)  # rows 1..written are in metrics.jsonl
        self._resume()
        self.journal = resume.Journal(state_dir / "journal.jsonl")
        self.journal.compact(self._state(), self._results())  # also drops a line a crash cut short

    def _written_rows(self) -> dict[int, dict]:
        """Metric rows already written (by a previous process): kept; a line cut short is dropped."""
        path = self.state_dir / "metrics.jsonl"
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
        with resume.atomic_path(path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {r["version"]: r for r in rows}

    def _resume(self) -> None:
        """Take over from the previous trainer process on this state dir, if there was one."""
        state, results = resume.Journal.read(self.state_dir / "journal.jsonl")
        if state is None:
            return
        version = self.trainer.version
        self.coord.restore(state["coordinator"], taken=version, results=results)
        run = state["run"]
        self.restarts, self.seconds_before, self.begun = run["restarts"] + 1, run["seconds"], run["begun"]
        self.sent = run["sent"]
        self.rows.update({int(v): r for v, r in run["rows"].items() if int(v) > self.written})
        self.gen = {int(b): x for b, x in run["gen"].items() if int(b) >= version}
        self.regions, self.first = run["regions"], run["first"]
        if version > self.written and version not in self.rows and self.trainer.row is not None:
            # killed after its checkpoint, before the row was journaled: complete it from the store
            self.rows[version] = self._row(self.trainer.row, self.trainer.extract_s, None)
        print(f"trainer: resumed at v{version} (restart {self.restarts}), {len(self.coord.leases)} leases live, "
              f"{sum(len(b.results) for b in self.coord.batches.values())} groups admitted for coming steps",
              flush=True)

    def _state(self) -> dict:
        """What the journal keeps besides admitted results (see resume.py)."""
        return {"coordinator": self.coord.state(),
                "run": {"restarts": self.restarts, "seconds": self._seconds(), "begun": self._started(),
                        "sent": self.sent, "rows": {v: r for v, r in self.rows.items() if v > self.written},
                        "gen": self.gen, "regions": self.regions, "first": self.first}}

    def _results(self, groups: tuple[int, list[int]] | None = None) -> resume.Results:
        """Admitted results of the batches not yet trained, or of `groups` (batch, its groups)."""
        if groups is None:
            return {b: batch.results for b, batch in self.coord.batches.items()}
        b, gs = groups
        return {b: {g: self.coord.batches[b].results[g] for g in gs}} if gs else {}

    def _seconds(self) -> float:
        return self.seconds_before + (time.perf_counter() - self.t_loop if self.t_loop else 0.0)

    def _row(self, partial: dict, extract_s: float | None, step_s: float | None) -> dict:
        p = self.trainer.published(partial["version"])
        return {**partial, "extract_s": extract_s, "payload_bytes": p["payload_bytes"], "dense_bytes": p["dense_bytes"],
                "changed_fraction": p["changed_fraction"], "step_s": step_s}

    def app(self, metrics_port: int | None = None, host: str = "127.0.0.1") -> web.Application:
        app = make_app(self.trainer.store.path, self.token, max_body=messages.max_body(self.spec.lease_tokens))
        app[SERVED].update(self.sent)  # counted on from a previous process's
        self.sent = app[SERVED]
        app.add_routes([web.get("/v1/job", self.h_job), web.get("/v1/model", self.h_model),
                        web.get(r"/v1/model/{name:[A-Za-z0-9][-A-Za-z0-9_.]{0,127}}", self.h_model_file),
                        web.post("/v1/work", self.h_work), web.post("/v1/results", self.h_results),
                        web.post("/v1/commit", self.h_commit), web.get("/v1/status", self.h_status)])
        add_health(app, lambda: self.coord.published >= 0)  # serving version 0 and taking work
        add_metrics(app, self.metrics, None if metrics_port is None else (host, metrics_port))
        return app

    def metrics(self) -> list:
        """/metrics: the status's counts, and the last step's phases."""
        s, c = self.status(), self.coord.counts
        last = self.rows[max(self.rows)] if self.rows else {}
        return [
            family("counter", "versions_published", "Policy versions published", s.version),
            family("counter", "steps", "Optimizer steps taken", s.step),
            family("gauge", "leases_active", "Leases out now", s.leases_active),
            family("counter", "leases_expired", "Leases whose deadline passed before their results", s.leases_expired),
            family("counter", "prompt_groups", "Prompt groups by what became of them",
                   by=("state", {"admitted": c.admitted, "refused": c.refused, "requeued": c.requeued,
                                 "duplicated": c.duplicated, "lost": s.prompt_groups_lost})),
            family("counter", "commit_verifications", "Worker commits, by whether their state hash was the trainer's",
                   by=("result", {"ok": c.verified, "mismatch": c.mismatched})),
            family("counter", "sent_bytes", "Bytes the origin sent, by kind",
                   by=("kind", {"delta": s.origin_sent_delta_bytes, "base": s.origin_sent_base_bytes})),
            family("gauge", "step_seconds", "The last step's time, by phase",
                   by=("phase", {p: last[f"{p}_s"] for p in ("generate", "train", "extract", "transfer", "wait")
                                 if last.get(f"{p}_s") is not None})),
            family("gauge", "changed_fraction", "Share of elements the last step changed", s.last_changed_fraction),
            family("gauge", "payload_bytes", "Bytes the last step shipped", s.last_payload_bytes),
            family("gauge", "worker_staleness", "Versions a worker's committed weights lag the newest",
                   by=("worker", {w.name: w.staleness for w in s.workers if w.staleness is not None})),
        ]

    async def _changed(self, seconds: float) -> None:
        """Until the coordinator's state changes (a publish, a result, a commit), or `seconds`."""
        try:
            await asyncio.wait_for(self.changed.wait(), seconds)
        except TimeoutError:
            pass

    def _touch(self, admitted: tuple[int, list[int]] | None = None) -> None:
        """The state changed: journal it (before the request that changed it is answered), and
        wake whoever waits for a change."""
        self.journal.append(self._state(), self._results(admitted))
        self.changed.set()
        self.changed = asyncio.Event()

    def _started(self) -> bool:
        """Rollouts start once every worker of the topology has called in (so all of them share
        the first batch), or after one lease period with those that have."""
        expected = sum(r.workers for r in self.spec.topology.regions)
        self.begun = self.begun or len(self.seen) >= expected or time.time() - self.t_start > self.spec.rollout.lease_seconds
        return self.begun

    async def h_job(self, request: web.Request) -> web.Response:
        g = self.spec.grpo
        return web.json_response({"group_size": g.group_size, "temperature": g.temperature,
                                  "max_new_tokens": g.max_new_tokens, "mode": self.spec.sync.mode,
                                  "engine": self.spec.rollout.engine, "streams": self.spec.sync.streams})

    async def h_model(self, request: web.Request) -> web.Response:
        """The files a worker builds its engine from (the config and the tokenizer, no weights:
        those come from the store), with their sizes and sha256: workers need no shared disk."""
        return web.json_response({"files": self.trainer.model_files})

    async def h_model_file(self, request: web.Request) -> web.FileResponse:
        name = request.match_info["name"]
        if name not in {f["name"] for f in self.trainer.model_files}:
            raise web.HTTPNotFound(text=f"no model file {name!r}")
        return web.FileResponse(self.trainer.model_dir / name)

    @property
    def workers(self) -> list[str]:
        """Workers heard from within a lease period: a lost one stops counting."""
        now = time.monotonic()
        return sorted(w for w, t in self.seen.items() if now - t < self.spec.rollout.lease_seconds)

    @once(messages.Work)
    async def h_work(self, body: dict) -> dict:
        self.seen[body["worker"]] = time.monotonic()
        if body["region"]:
            self.regions[body["worker"]] = body["region"]
        deadline = time.monotonic() + 10
        while True:
            ans = self.coord.work(body["worker"], body["version"]) if self._started() else {"wait": True}
            if "wait" not in ans or time.monotonic() > deadline:
                break
            await self._changed(1.0)
        if "lease" in ans:
            self._touch()  # journaled before it is answered: a restarted trainer knows the lease
            ans["lease"]["prompts"] = [{"group": g, "ids": models.prompt_ids(self.trainer.tok, self.trainer.prompt(g).prompt),
                                        "seed": group_seed(self.spec.seed, g)} for g in ans["lease"]["groups"]]
        return ans

    @once(messages.Results)
    async def h_results(self, body: dict) -> dict:
        self.seen[body["worker"]] = time.monotonic()
        results = body["results"]
        if bad := self._malformed(results):
            self.coord.refuse(body["lease"], body["worker"])
            self._touch()
            return {"admitted": 0, "refused": bad}
        ans = self.coord.submit(body["lease"], body["worker"], body["version"], body["state_hash"], results)
        if ans["admitted"]:
            self.gen[ans["batch"]] = self.gen.get(ans["batch"], 0.0) + body["generate_s"]
        self._touch((ans["batch"], ans.pop("groups")) if ans["admitted"] else None)  # admitted: journaled first
        return ans

    @staticmethod
    def _lease_of(raw: object) -> messages.LeaseOf | None:
        try:
            return messages.LeaseOf.model_validate(raw, strict=False) if isinstance(raw, dict) else None
        except ValueError:
            return None

    def _malformed(self, results: dict[int, dict]) -> str | None:
        """Workers are not trusted: a result that would break the training step is refused."""
        g, vocab = self.spec.grpo, len(self.trainer.tok)
        for group, r in results.items():
            samples = r["samples"]
            if len(samples) != g.group_size:
                return f"group {group}: {len(samples)} samples, the job's group size is {g.group_size}"
            for x in samples:
                t, lp = x["tokens"], x["logprobs"]
                if not 1 <= len(t) <= g.max_new_tokens or len(t) != len(lp):
                    return f"group {group}: {len(t)} tokens with {len(lp)} log-probs (1..{g.max_new_tokens} tokens)"
                if not all(0 <= i < vocab for i in t):
                    return f"group {group}: a token id outside the vocabulary (0..{vocab - 1})"
        return None

    @once(messages.Commit)
    async def h_commit(self, body: dict) -> dict:
        self.seen[body["worker"]] = time.monotonic()
        deadline = time.monotonic() + 30
        while body["version"] > self.coord.published and time.monotonic() < deadline:
            # a worker can hold a delta before the trainer has finished storing it
            await self._changed(1.0)
        self.first.setdefault(body["worker"], body["version"])
        ok = self.coord.commit(body["worker"], body["version"], body["state_hash"])
        if body.get("fetch_s") is not None:
            self.fetch.setdefault(body["version"], {})[body["worker"]] = body["fetch_s"]
        self._flush()
        self._touch()
        return {"verified": ok}

    async def h_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status().model_dump())

    def status(self) -> JobStatus:
        rows = [self.rows[v] for v in sorted(self.rows)]
        c, now, newest = self.coord.counts, time.monotonic(), self.coord.published
        held, live = {}, set(self.workers)
        for lease in self.coord.leases.values():
            held[lease.worker] = held.get(lease.worker, 0) + 1
        workers = []
        for w in sorted(self.seen):
            version, h = self.coord.commits.get(w, (None, None))
            workers.append(WorkerStatus(
                name=w, region=self.regions.get(w), committed_version=version,
                staleness=None if version is None else max(0, newest - version),
                last_verification=None if version is None else "ok" if self.coord.hashes.get(version) == h else "mismatch",
                seconds_since_seen=now - self.seen[w], leases_held=held.get(w, 0),
                stale=w not in live))
        running = self._seconds()
        return JobStatus(
            phase="Succeeded" if self.finished else "Running" if self._started() else "Pending",
            step=len(rows), steps=self.spec.steps, version=newest,
            reward_last=rows[-1]["reward_mean"] if rows else None,
            reward_mean_10=sum(r["reward_mean"] for r in rows[-10:]) / len(rows[-10:]) if rows else None,
            tokens_per_second=sum(r["tokens"] for r in rows) / running if rows and running else None,
            last_payload_bytes=rows[-1]["payload_bytes"] if rows else None,
            last_changed_fraction=rows[-1]["changed_fraction"] if rows else None,
            leases_active=len(self.coord.leases), leases_expired=c.leases_expired,
            prompt_groups_admitted=c.admitted, prompt_groups_requeued=c.requeued, prompt_groups_lost=self.coord.lost,
            prompt_groups_duplicated=c.duplicated, commits_verified=c.verified, commits_mismatched=c.mismatched,
            origin_sent_delta_bytes=self.sent["delta"], origin_sent_base_bytes=self.sent["base"],
            workers=workers, stale_workers=[w.name for w in workers if w.stale])

    def _flush(self, final: bool = False) -> None:
        """Write metric rows in order once every worker has staged their version (or at the end)."""
        with open(self.state_dir / "metrics.jsonl", "a") as f:
            while self.written + 1 in self.rows:
                v = self.written + 1
                staged = self.fetch.get(v, {})
                if not final and any(w not in staged and self.first.get(w, -1) < v
                                     and self.coord.commits.get(w, (-1,))[0] < v for w in self.workers):
                    break
                row = self.rows[v]
                row["transfer_s"] = max(staged.values(), default=None)
                f.write(json.dumps(row) + "\n")
                self.written = v

    async def train_loop(self) -> None:
        """From the version the trainer holds (0, or where a previous process stopped) to the last."""
        self.t_loop = time.perf_counter()
        self._flush()
        for b in range(self.trainer.version, self.spec.steps):
            t0 = time.perf_counter()
            while (batch := self.coord.take(b)) is None:
                self.coord.expire()
                await self._changed(0.2)  # a result admitted, or time to expire leases
            self._touch()
            wait = time.perf_counter() - t0
            m = await asyncio.to_thread(self.trainer.train, batch)
            n_workers = max(1, len(self.workers))
            partial = {"version": b + 1, "step": b, **m, "generate_s": self.gen.pop(b, 0.0) / n_workers, "wait_s": wait}
            await asyncio.to_thread(self.trainer.checkpoint, partial)
            self.journal.compact(self._state(), self._results())  # batch b's results are in the checkpoint now
            extract_s = await asyncio.to_thread(self.trainer.publish)
            self.coord.publish(b + 1, self.trainer.store.versions[b + 1].state_hash)
            self.rows[b + 1] = self._row(partial, extract_s, time.perf_counter() - t0)
            self._touch()
            self._flush()
        # every worker should still commit and verify the final version
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(self.coord.commits.get(w, (-1,))[0] < self.spec.steps for w in self.workers):
            await self._changed(deadline - time.monotonic())
        self._flush(final=True)
        self.trainer.save(self.state_dir / "final")
        self.summary(self._seconds())
        self.finished = True
        self._touch()

    def summary(self, seconds: float) -> dict:
        rows = [json.loads(x) for x in (self.state_dir / "metrics.jsonl").read_text().splitlines()]
        tenth = max(1, len(rows) // 10)
        c = self.coord.counts
        s = {"steps": len(rows), "reward_first": sum(r["reward_mean"] for r in rows[:tenth]) / tenth,
             "reward_last": sum(r["reward_mean"] for r in rows[-tenth:]) / tenth,
             "weights_verified": c.verified, "weights_mismatch": c.mismatched,
             "payload_bytes_total": sum(r["payload_bytes"] for r in rows),
             "dense_bytes_total": sum(r["dense_bytes"] for r in rows),
             "origin_sent_delta_bytes": self.sent["delta"], "origin_sent_base_bytes": self.sent["base"],
             "prompt_groups_admitted": c.admitted, "prompt_groups_lost": self.coord.lost,
             "prompt_groups_duplicated": c.duplicated, "prompt_groups_requeued": c.requeued,
             "leases_expired": c.leases_expired, "trainer_restarts": self.restarts,
             "tokens_per_second": sum(r["tokens"] for r in rows) / seconds, "seconds": seconds,
             "mode": self.spec.sync.mode, "final_version": self.coord.published,
             "final_state_hash": self.coord.hashes[self.coord.published]}
        (self.state_dir / "summary.json").write_text(json.dumps(s, indent=1))
        return s


async def serve(spec: JobSpec, state_dir: Path, host: str, port: int, token: str,
                metrics_port: int | None = None) -> None:
    run = Run(spec, state_dir, token)
    runner = web.AppRunner(run.app(metrics_port, host))
    await runner.setup()
    await listen(runner, host, port)
    print(f"trainer: serving on {host}:{port}", flush=True)
    try:
        await run.train_loop()
        await asyncio.sleep(2.0)  # let workers see `finished` and the runner read the summary
    finally:
        await runner.cleanup()
