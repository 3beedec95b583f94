"""The learner: fp32 master weights and AdamW, a GRPO step on a complete batch, a checkpoint
after it, and the new bf16 policy's delta streamed into the checkpoint store, where the server
publishes it as it is written (cut-through).

With `trainer.ranks` N > 1 the model is sharded with FSDP2 over N processes (ranks.py). Rank 0 is
the trainer's process: it leads, and ranks 1..N-1 run `follow`, which makes the same calls (and
so the same collectives) as rank 0 makes, in the same order. Each rank trains on its share of a
batch's groups, checkpoints its shards, and diffs and encodes its own part of the policy
(sync/shards.py); rank 0 alone holds the store.

One rank trains where `trainer.device` says: on a GPU, in bf16 under autocast with fp32 master
weights and AdamW state (what FSDP2's MixedPrecisionPolicy gives the sharded ranks); on the CPU,
in fp32. The bf16 policy is the cast of the fp32 master weights, the same bits on either device,
and is diffed where it lives (CuPy on a GPU)."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import math
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from transformers import AutoConfig

from sparrowrl.rollout import evals
from sparrowrl.rollout.coordinator import Batch
from sparrowrl.spec.job import JobSpec
from sparrowrl.store.checkpoint_io import save_stream
from sparrowrl.sync import Publisher, shards
from sparrowrl.trainer import grpo, hub, lr, models, ranks, resume, rewards, shard, tasks


def device(choice: str, world: int = 1) -> torch.device:
    """Where the trainer's rank trains, for `trainer.device` (auto, cpu or cuda); a choice this
    machine cannot meet is a ValueError naming the field, before anything is written. Sharded
    ranks take the GPUs whenever there are (shard.device)."""
    cuda = torch.cuda.is_available()
    if choice == "cuda" and not cuda:
        raise ValueError(f"trainer.device: cuda, but torch {torch.__version__} sees no CUDA device")
    if world > 1:
        if choice == "cpu" and cuda:
            raise ValueError(
                f"trainer.device: cpu with trainer.ranks {world} on a machine with GPUs: sharded ranks take a GPU "
                f"each (train on the CPU with ranks: 1)"
            )
        at = shard.device()
    else:
        at = torch.device("cuda", torch.cuda.current_device()) if choice != "cpu" and cuda else torch.device("cpu")
    if at.type == "cuda" and importlib.util.find_spec("cupy") is None:
        raise ValueError(
            f"trainer.device: {choice} trains on the GPU, whose policy is diffed there with CuPy, which is not "
            f"installed: install sparrowrl[gpu], or set trainer.device: cpu"
        )
    return at


T = TypeVar("T")
SKIPPED = ("nothing_to_train", "all_refused", "nonfinite")  # why a step changed no weight


class Learner:
    """The model, its optimizer and the store. Started on a state dir that holds a checkpoint, it
    goes on from there (see resume.py): `version` is how many steps its weights have taken, the
    version they publish as (the store may be ahead after a restart: `trainer.Trainer` trains
    those steps again without publishing them)."""

    def __init__(self, spec: JobSpec, state_dir: Path, rank: int = 0, restarts: int | None = None):
        self.spec, self.state_dir, self.rank, self.world = spec, state_dir, rank, spec.trainer.ranks
        self.device = device(spec.trainer.device, self.world)  # before the state dir is touched
        self.ranks = None
        if rank == 0:
            # processes before this one; `held` keeps a second trainer off the state dir while this one lives
            self.restarts, self.held = resume.claim(state_dir, spec.model_dump(mode="json"))
            hub.fetch(spec, state_dir)  # once per state dir, before the other ranks look for it
            if self.world > 1:
                resume.ShardedCheckpoints(state_dir / "trainer", 0).clear_partial()  # before any rank writes
                self.ranks = ranks.start(self.world, follow, spec, state_dir, self.restarts)
        else:
            self.restarts = restarts
        if self.world > 1:
            self.device = shard.device()  # this rank's GPU, now that it has joined
        torch.manual_seed(spec.seed)
        local = hub.localize(spec, state_dir)  # what came from the hub, read from the state dir
        self.tok = models.tokenizer(local)
        self.prompts = models.Prompts.for_job(local, self.tok)
        self.task, reward = tasks.for_job(local, self.prompts)
        if rank == 0 and self.task.skipped:
            print(f"trainer: task: {self.task.skipped}", flush=True)
        self.held_out = tasks.held_out(local, self.prompts, self.task) if rank == 0 else []  # task.eval
        keep = spec.trainer.checkpoint.keep
        self.saved = (
            resume.Checkpoints(state_dir / "trainer", keep)
            if self.world == 1
            else resume.ShardedCheckpoints(state_dir / "trainer", rank, keep)
        )
        newest = self.saved.newest() if self.restarts else None
        self.model, self.ref = self._models(local, warm=newest is None)
        g = spec.grpo
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
        self.table = shards.specs(self.model)
        if newest is None:
            if self.ref is not None:
                self.saved.save_ref(self.ref)
            self.version = 0
            self._checkpoint()()
        else:
            if self.ref is not None:
                self.saved.load_ref(self.ref)
            self.version = newest
            self.saved.load(newest, self.model, self.opt)
        self.model.train()
        eos = self.model.config.eos_token_id
        self.eos = {self.tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}  # as engines end
        self.dense_bytes = sum(t.numel * 2 for t in self.table)
        self.model_dir = state_dir / "model"
        if rank == 0:  # workers build the architecture from this folder; the weights come from the store
            self.model.config.save_pretrained(self.model_dir)
            self.tok.save_pretrained(self.model_dir)
            self.model_files = [
                {"name": f.name, "bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                for f in sorted(self.model_dir.iterdir())
                if f.is_file()
            ]
        self.publisher = self._open_store()
        self.store = self.publisher.store  # rank 0's; None on the others
        # rank 0 scores each batch, and hands the rewards to the other ranks
        self.scorer = (
            rewards.Scorer(reward, spec.task.reward_workers, spec.task.reward_timeout_seconds) if rank == 0 else None
        )

    def _models(self, spec: JobSpec, warm: bool):
        """(policy model, frozen reference or None). One rank: the model as loaded. N
        ranks: each rank allocates only its shards (shard.build), filled from rank 0's tiny model
        or from its rows of the checkpoint's files. `spec`: the job, its hub model a local folder."""
        if spec.model.tiny:
            tok = self.tok
            t = spec.model.tiny
            full = None
            if self.rank == 0:
                full = models.tiny_qwen3(len(tok), t.hidden, t.layers, t.heads, spec.seed)
                if warm and t.warmup_steps:
                    models.warm_up(full, self.prompts, self.task, t.warmup_steps)
            model = (
                full.to(self.device)
                if self.world == 1
                else shard.build(models.tiny_config(len(tok), t.hidden, t.layers, t.heads), shard.from_rank0(full))
            )
        else:
            if self.world == 1:
                model = models.load(spec.model.path, spec.model.tokenizer)[0].to(self.device)
            else:
                model = shard.build(
                    AutoConfig.from_pretrained(spec.model.path, local_files_only=True),
                    shard.from_files(spec.model.path),
                )
        ref = None
        if spec.grpo.kl_coef > 0:  # KL's anchor
            ref = copy.deepcopy(model) if self.world == 1 else shard.build(model.config, shard.from_model(model))
            ref.eval().requires_grad_(False)
        return model, ref

    def _open_store(self) -> Publisher:
        """The publisher of this model's versions, on the store in the state dir: a new one, or the
        store a previous process wrote, whose newest version the next one is diffed against. The
        checkpoint is never ahead of the store (a step publishes, then checkpoints); the store may
        be ahead of it, by the steps after the checkpoint, which are trained again (the policy
        they would publish is already there)."""
        path = self.state_dir / "store"
        if self.version and self._agree(not (path / "store.json").exists()):
            raise resume.ResumeError(f"{path}: missing, and the checkpoint is at v{self.version}")
        publisher = Publisher(
            self.model,
            path,
            base_every=1 if self.spec.sync.mode == "full" else self.spec.sync.base_every,
            cut_through=self.spec.sync.cut_through,
        )
        if publisher.version < self.version:
            raise resume.ResumeError(
                f"{path}: its newest version v{publisher.version} is older than the checkpoint's v{self.version} (a "
                f"state dir written by a trainer that checkpointed before it published, killed in between)"
            )
        return publisher

    def _agree(self, decision: T) -> T:
        """Rank 0's decision, on every rank (what only the store's holder can see)."""
        if self.world == 1:
            return decision
        box = [decision]
        dist.broadcast_object_list(box, src=0)
        return box[0]

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
        items = []
        for i, res in sorted(results.items()):
            ex = self.held_out[i]
            for s in res["samples"]:
                items.append((ex.prompt, models.completion_text(self.tok, s["tokens"]), ex.answer, ex.fields))
        flat, failed = self.scorer.score(items)
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
        """Groups' samples scored in one call: each group's rewards, and the failures by kind."""
        items = []
        for group, res in results.items():
            ex = self.prompt(group)
            for s in res["samples"]:
                items.append((ex.prompt, models.completion_text(self.tok, s["tokens"]), ex.answer, ex.fields))
        flat, failed = self.scorer.score(items)
        n = self.spec.grpo.group_size
        return {g: flat[i * n : (i + 1) * n] for i, g in enumerate(results)}, failed

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
        """A group's rewards after overlong shaping: what its advantages are taken from."""
        return [r + self._overlong(len(s["tokens"])) for r, s in zip(rewards, samples, strict=True)]

    def _lead(self, method: str, *args) -> None:
        """On rank 0 of a sharded trainer: have the other ranks make the same call."""
        if self.world > 1 and self.rank == 0:
            dist.broadcast_object_list([(method, args)], src=0)

    def train(self, batch: Batch, scored: tuple[list[list[float]], dict[str, int]] | None = None) -> dict:
        """One step on a complete batch (`grpo.updatesPerBatch` optimizer updates); returns its
        metrics. Rank 0 scores the batch and hands the rewards (`scored`) to the others. Each rank
        takes every N-th group; every row's loss weight is the whole batch's, so the ranks'
        averaged gradient is the one-rank gradient. A step that has nothing to train, or whose
        loss or gradient is not finite, changes no weight: it is skipped, and says why."""
        g = self.spec.grpo
        t0 = time.perf_counter()
        rewards, failed = scored or self._score(batch)
        self._lead("train", batch, (rewards, failed))
        samples = [batch.results[group]["samples"] for group in batch.groups]
        ends = [[self._finish(s["tokens"]) for s in group] for group in samples]  # the trainer's reading
        r = torch.tensor(rewards, dtype=torch.float32)  # finite and bounded (rewards.MAX_REWARD)
        shaped = torch.tensor([self._shaped(x, group) for x, group in zip(rewards, samples)])
        varied = (shaped.max(1).values != shaped.min(1).values).tolist()
        claims = {  # (group, sample) whose worker said it ended otherwise than its tokens show
            (i, j)
            for i, group in enumerate(samples)
            for j, s in enumerate(group)
            if s.get("finish") not in (None, ends[i][j])  # None: a worker from before workers said
        }
        trained = [
            [
                (v or g.zero_variance_groups == "train")  # refill: the batch holds others in their place
                and not (g.mask_truncated and ends[i][j] == "length")
                and (i, j) not in claims
                for j in range(len(group))
            ]
            for i, (v, group) in enumerate(zip(varied, samples))
        ]
        rows, mine, lengths = [], [], []  # mine: (group, sample) of this rank's rows
        for i, group in enumerate(batch.groups):
            p = self.prompt_ids(group)
            for j, s in enumerate(samples[i]):
                if i % self.world == self.rank:
                    rows.append((p, s["tokens"], s["logprobs"]))
                    mine.append((i, j))
                lengths.append((len(s["tokens"]), trained[i][j]))
        n = sum(t for _, t in lengths)  # samples trained, over every rank
        tokens = sum(k for k, t in lengths if t)
        adv = grpo.advantages(shaped, g.scale_rewards)[[i for i, _ in mine], [j for _, j in mine]].to(self.device)
        how = (g.loss_aggregation, g.max_new_tokens)
        scale = torch.tensor(  # times the ranks, whose gradients are averaged
            [
                self.world * grpo.row_weight(len(c), n, tokens, *how) * trained[i][j]
                for (i, j), (_, c, _) in zip(mine, rows)
            ],
            device=self.device,
        )
        rate = lr.rate(self.version, g, self.spec.steps)  # step `version` makes version + 1
        for group in self.opt.param_groups:
            group["lr"] = rate
        prox = self._proximal(rows) if g.updates_per_batch > 1 and n else None
        skipped = None if n else "nothing_to_train"
        total, seen, losses, norms = grpo.Stats(), None, [], []
        for _ in range(g.updates_per_batch if n else 0):
            self.opt.zero_grad(set_to_none=True)
            loss, stats = self._backward(rows, adv, scale, prox)
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.max_grad_norm)
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            seen = seen or self._rows(stats.rows)
            stats.rows = []
            total.add(stats)
            losses.append(loss)
            norms.append(norm)
            if not (math.isfinite(loss) and math.isfinite(norm)):
                skipped = "nonfinite"
            elif not any(trained[i][j] and not x[3] for (i, j), x in seen.items()):
                skipped = "all_refused"
            if skipped:
                self.opt.zero_grad(set_to_none=True)
                break
            self.opt.step()
        self.version += 1
        return {
            "reward_mean": float(r.mean()),
            "reward_exact": float((r == 1).float().mean()),
            "loss": _finite(sum(losses) / max(len(losses), 1)),
            "grad_norm": _finite(sum(norms) / max(len(norms), 1)),
            "lr": rate,
            "tokens": sum(k for k, _ in lengths),
            "train_s": time.perf_counter() - t0,
            "skipped": skipped,
            **self._diagnostics(total),
            **self._behaviour(batch, seen or {}, claims),
            "zero_variance_groups": 1.0 - sum(varied) / len(varied),
            "groups_varied": sum(varied),
            "refill_groups": len(batch.groups) - g.prompts_per_step,
            "truncated": sum(e == "length" for group in ends for e in group) / len(lengths),
            "completion_len_min": min(k for k, _ in lengths),
            "completion_len_max": max(k for k, _ in lengths),
            "behaviour_versions": sorted({res["version"] for res in batch.results.values()}),
            "reward_failed": failed,
        }

    def _proximal(self, rows: list[grpo.Row]) -> list[torch.Tensor]:
        g = self.spec.grpo
        return grpo.proximal(
            self.model,
            rows,
            self._batches(rows),
            pad_id=self.tok.pad_token_id,
            temperature=g.temperature,
            device=self.device,
            bf16=self._bf16(),
        )

    def _batches(self, rows: list[grpo.Row]) -> list[list[int]]:
        budget = self.spec.grpo.micro_batch_tokens
        return grpo.micro_batches(rows, budget) if self.world == 1 else shard.micro_batches(rows, budget)

    def _bf16(self) -> bool:
        return self.world == 1 and self.device.type == "cuda"  # the sharded ranks' is FSDP2's policy

    def _backward(
        self, rows: list[grpo.Row], adv: torch.Tensor, scale: torch.Tensor, prox: list[torch.Tensor] | None
    ) -> tuple[float, grpo.Stats]:
        """The gradient of this rank's rows, in micro-batches of `grpo.microBatchTokens` (one pass
        without it); the loss and its stats, over the whole batch (every rank) as one pass gives
        them (rows: every rank's, as (rank, index) → row stats)."""
        loss, stats = grpo.accumulate(
            self.model,
            self.ref,
            rows,
            adv,
            scale,
            self._batches(rows),
            pad_id=self.tok.pad_token_id,
            objective=grpo.Objective.of(self.spec.grpo),
            device=self.device,
            bf16=self._bf16(),
            prox=prox,
        )
        if self.world > 1:
            stats.sums = {k: float(self._sum(torch.tensor(v, device=self.device))) for k, v in stats.sums.items()}
            stats.highs = {
                k: float(self._sum(torch.tensor(v, device=self.device), dist.ReduceOp.MAX))
                for k, v in stats.highs.items()
            }
            every: list = [None] * self.world
            dist.all_gather_object(every, stats.rows)
            stats.rows = [(rank, x) for rank, part in enumerate(every) for x in part]
        else:
            stats.rows = [(0, x) for x in stats.rows]
        return float(self._sum(loss)) / self.world, stats

    def _rows(self, rows: list[tuple[int, tuple]]) -> dict[tuple[int, int], tuple]:
        """Every rank's row stats by (group, sample): rank k's rows are the batch's groups k,
        k + N, ..., their samples in order."""
        per_rank = [[x for rank, x in rows if rank == k] for k in range(self.world)]
        n = self.spec.grpo.group_size
        return {(k + self.world * (m // n), m % n): x for k, part in enumerate(per_rank) for m, x in enumerate(part)}

    def _diagnostics(self, st: grpo.Stats) -> dict[str, float]:
        """The step's means over its completion tokens (and every update of it)."""
        s, h = st.sums, st.highs
        n = max(s.get("tokens", 0.0), 1.0)
        out = {k: s[k] / n for k in ("entropy", "clip_low", "clip_high", "clip_dual", "kl") if k in s}
        if "tokens" not in s:
            return out
        return {
            **out,
            "is_weight_mean": s["weight"] / n,
            "is_weight_min": -h.get("weight_neg", -1.0),
            "is_weight_max": h.get("weight", 1.0),
            "is_masked": s["masked"] / n,
            "is_truncated": s.get("truncated", 0.0) / n,
            "is_ess": s["weight_applied"] ** 2 / (n * s["weight_applied_sq"]) if s["weight_applied_sq"] else 0.0,
            "mismatch_mean": s["gap"] / n,
            "mismatch_max": h.get("gap", 0.0),
            "mismatch_kl": s["mismatch_kl"] / n,
        }

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

    def _behaviour(self, batch: Batch, seen: dict[tuple[int, int], tuple], claims: set[tuple[int, int]]) -> dict:
        """The samples' gaps between the worker's log-probs and the trainer's, by the age of the
        version that sampled them and by worker; and the refused samples, by worker and reason
        (`claims`: those whose worker said they ended otherwise than their tokens show)."""
        by_age: dict[str, dict] = {}
        by_worker: dict[str, dict] = {}
        refused: dict[str, dict[str, int]] = {}
        for i, group in enumerate(batch.groups):
            res = batch.results[group]
            worker = res.get("worker", "unknown")  # results journaled before workers were kept have none
            for j in range(len(res["samples"])):
                gapped = (i, j) in seen and seen[i, j][3]
                why = [w for w, yes in (("logprob_gap", gapped), ("finish_claim", (i, j) in claims)) if yes]
                for w in why:
                    refused.setdefault(worker, {}).setdefault(w, 0)
                    refused[worker][w] += 1
                if (i, j) not in seen:  # a step with nothing to train makes no pass
                    continue
                t, gap, top, _ = seen[i, j]
                for key, into in ((str(batch.index - res["version"]), by_age), (worker, by_worker)):
                    d = into.setdefault(key, {"samples": 0, "tokens": 0, "gap": 0.0, "mismatch_max": 0.0, "refused": 0})
                    d["samples"] += 1
                    d["tokens"] += t
                    d["gap"] += gap
                    d["mismatch_max"] = max(d["mismatch_max"], top)
                    d["refused"] += bool(why)
        for d in (*by_age.values(), *by_worker.values()):
            d["mismatch_mean"] = d.pop("gap") / max(d["tokens"], 1)
        return {"by_age": by_age, "by_worker": by_worker, "refused_samples": refused}

    def _sum(self, x: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """`x` summed over the ranks (or reduced by `op`)."""
        if self.world == 1:
            return x
        x = x.detach().clone().float()
        dist.all_reduce(x, op)
        return x

    def checkpoint(self) -> Callable[[], None]:
        """Checkpoint the weights as they are (after step `version`): what must happen before
        the next step changes them happens now (one rank: a copy on the host; sharded: the whole
        collective write); the rest is returned, to run off the step's critical path."""
        self._lead("checkpoint")
        return self._checkpoint()

    def _checkpoint(self) -> Callable[[], None]:
        if self.world == 1:
            return self.saved.prepare(self.version, self.model, self.opt)
        self.saved.save(self.version, self.model, self.opt)
        return lambda: None

    def holds(self, version: int) -> bool:
        """Whether the policy these weights make is the store's `version`, by state hash (rank 0's
        answer: after steps trained again, they are the same bits where training is deterministic)."""
        self._lead("holds", version)
        held = self.publisher.weights_hash()
        return self.store is not None and held == self.store.versions[version].state_hash

    def publish(self) -> float:
        """Stream the new bf16 policy's delta into the store (served as it is written); returns
        the seconds it took."""
        self._lead("publish")
        t0 = time.perf_counter()
        self.publisher.publish()
        return time.perf_counter() - t0

    def published(self, version: int) -> dict:
        """What version `version` shipped, from the store's index."""
        v = self.store.versions[version]
        return {
            "version": version,
            "state_hash": v.state_hash,
            "changed_fraction": v.changed / sum(t.numel for t in self.table),
            "payload_bytes": v.base_bytes if self.spec.sync.mode == "full" else v.delta_bytes,
            "dense_bytes": self.dense_bytes,
        }

    def save(self, out: Path) -> None:
        """The trained model (fp32, as trained) and its tokenizer: a Hugging Face folder. A
        sharded trainer writes it one gathered tensor at a time."""
        self._lead("save", out)
        if self.world == 1:
            self.model.save_pretrained(out)
        else:
            shards.stream(
                self.model,
                None if self.rank else lambda s: save_stream(s.specs, s.tensors, out / "model.safetensors"),
                torch.float32,
            )
            if self.rank:
                return
            self.model.config.save_pretrained(out)
        self.tok.save_pretrained(out)

    def stop(self) -> None:
        """The last call: the reward's processes end, and the other ranks leave `follow` and exit."""
        if self.scorer is not None:
            self.scorer.close()
        if self.ranks is not None:
            self.ranks.stop(lambda: self._lead("stop"))


def _finite(x: float) -> float | None:
    """A metric as JSON can carry it: None for a non-finite one."""
    return x if math.isfinite(x) else None


def follow(spec: JobSpec, state_dir: Path, restarts: int) -> None:
    """Ranks 1..N-1 of a sharded trainer: the same learner, making each call rank 0 makes."""
    learner = Learner(spec, state_dir, dist.get_rank(), restarts)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        if method == "stop":
            return
        getattr(learner, method)(*args)
