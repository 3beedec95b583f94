"""The learner: fp32 master weights and AdamW, a GRPO step on a complete batch, a checkpoint
after it, and the new bf16 policy's delta streamed into the checkpoint store, where the server
publishes it as it is written (cut-through).

With `trainer.nodes` × `trainer.ranks` N > 1 the model is sharded with FSDP2 over N processes
(ranks.py; across nodes they meet by rendezvous.py), or with HSDP (`trainer.sharding: hybrid`:
sharded within a node, replicated across nodes). Rank 0 is the trainer's process: it leads, and
ranks 1..N-1 run `follow`, which makes the same calls (and so the same collectives) as rank 0
makes, in the same order. Each rank trains on its share of a
batch's groups, checkpoints its shards, and diffs and encodes its own part of the policy
(sync/gather.py); rank 0 alone holds the store.

One rank trains where `trainer.device` says: on a GPU, in bf16 under autocast with fp32 master
weights and AdamW state (what FSDP2's MixedPrecisionPolicy gives the sharded ranks); on the CPU,
in fp32. The bf16 policy is the cast of the fp32 master weights, the same bits on either device,
and is diffed where it lives (CuPy on a GPU)."""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from transformers import AutoConfig

from sparrowrl.agents.turns import Turns, end_tokens
from sparrowrl.rollout.coordinator import Batch
from sparrowrl.spec.job import JobSpec
from sparrowrl.store.checkpoint_io import save_stream
from sparrowrl.sync import Publisher, gather
from sparrowrl.trainer import fsdp, grpo, hub, lr, models, ranks, rendezvous, resume, rewards, step_metrics, tasks
from sparrowrl.trainer.device import device
from sparrowrl.trainer.scoring import Scoring

T = TypeVar("T")
SKIPPED = ("nothing_to_train", "all_refused", "nonfinite")  # why a step changed no weight

log = logging.getLogger(__name__)


class Learner(Scoring):
    """The model, its optimizer and the store. Started on a state dir that holds a checkpoint, it
    goes on from there (see resume.py): `version` is how many steps its weights have taken, the
    version they publish as (the store may be ahead after a restart: `trainer.Trainer` trains
    those steps again without publishing them)."""

    def __init__(self, spec: JobSpec, state_dir: Path, gang: rendezvous.Gang | None = None, rank: int = 0):
        """`gang`: where this process's node meets the others (by default one node on loopback);
        `rank`: this process's, among all the nodes' (a node's first process makes the others)."""
        self.gang = gang = gang or rendezvous.Gang.of(spec)
        self.spec, self.state_dir, self.rank, self.world = spec, state_dir, rank, gang.world
        self.device = device(spec.trainer.device, gang.world)  # before the state dir is touched
        self.ranks, self.mesh = None, None
        restarts = None
        if rank == gang.first:  # this node's first process: its state dir is its own (each node has a volume)
            # processes before this one; `held` keeps a second trainer off the state dir while this one lives
            restarts, self.held = resume.claim(state_dir, spec.model_dump(mode="json"))
            hub.fetch(spec, state_dir)  # once per state dir, before the node's other ranks look for it
            if self.world > 1:
                self._sharded(0).clear_partial()  # before any rank writes
                self.ranks = ranks.start(gang, rendezvous.describe(spec), follow, spec, state_dir, gang)
        if self.world > 1:
            self.device = fsdp.device()  # this rank's GPU, now that it has joined
            self.mesh = fsdp.mesh(gang.nodes, spec.trainer.sharding)
        agreed = self._agree(restarts)  # rank 0's count: whether there is a checkpoint to look for
        assert agreed is not None  # rank 0 is a node's first process
        self.restarts = agreed
        torch.manual_seed(spec.seed)
        local = hub.localize(spec, state_dir)  # what came from the hub, read from the state dir
        self.tok = models.tokenizer(local)
        self.prompts = models.Prompts.for_job(local, self.tok)
        self.task, reward = tasks.for_job(local, self.prompts)
        if rank == 0 and self.task.skipped:
            log.warning(f"trainer: task: {self.task.skipped}")
        if rank == 0 and local.task.environment and local.task.environment.trust_worker_rewards:
            log.warning("trainer: task.environment.trustWorkerRewards: rewards are the workers' own scores, unchecked")
        self.held_out = tasks.held_out(local, self.prompts, self.task) if rank == 0 else []  # task.eval
        keep = spec.trainer.checkpoint.keep
        self.saved = resume.Checkpoints(state_dir / "trainer", keep) if self.world == 1 else self._sharded(keep)
        if isinstance(self.saved, resume.ShardedCheckpoints):  # the newest whole on every node
            newest = self.saved.agree(fresh=not self.restarts)
        else:
            newest = self.saved.newest() if self.restarts else None
        self.model, self.ref = self._models(local, warm=newest is None)
        g = spec.grpo
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
        self.table = gather.specs(self.model)
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
        self.eos = end_tokens(self.tok, self.model.config.eos_token_id)
        self.turns = Turns(self.tok, self.prompts.templated, self.eos) if spec.task.environment else None
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
        self.scorer = rewards.for_job(local, reward) if rank == 0 else None

    def _models(self, spec: JobSpec, warm: bool):
        """(policy model, frozen reference or None). One rank: the model as loaded. N
        ranks: each rank allocates only its shards (fsdp.build), filled from rank 0's tiny model
        or from its rows of the checkpoint's files. `spec`: the job, its hub model a local folder."""
        if spec.model.tiny:
            tok = self.tok
            t = spec.model.tiny
            full: torch.nn.Module | None = None
            if self.rank == 0:
                full = models.tiny_qwen3(len(tok), t.hidden, t.layers, t.heads, spec.seed)
                if warm and t.warmup_steps:
                    models.warm_up(full, self.prompts, self.task, t.warmup_steps)
            model = (
                full.to(self.device)
                if self.world == 1 and full is not None  # one rank: rank 0, which made it
                else fsdp.build(
                    models.tiny_config(len(tok), t.hidden, t.layers, t.heads), fsdp.from_rank0(full), self.mesh
                )
            )
        else:
            path = spec.model.path
            assert path is not None  # not tiny: a folder (a hub model's, localized)
            if self.world == 1:
                model = models.load(path, spec.model.tokenizer)[0].to(self.device)
            else:
                model = fsdp.build(
                    AutoConfig.from_pretrained(path, local_files_only=True), fsdp.from_files(path), self.mesh
                )
        ref = None
        if spec.grpo.kl_coef > 0:  # KL's anchor
            ref = (
                copy.deepcopy(model) if self.world == 1 else fsdp.build(model.config, fsdp.from_model(model), self.mesh)
            )
            ref.eval().requires_grad_(False)
        return model, ref

    def _sharded(self, keep: int) -> resume.ShardedCheckpoints:
        g = self.gang
        return resume.ShardedCheckpoints(
            self.state_dir / "trainer", self.rank, self.world, g.node, self.rank == g.first, keep
        )

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
        ends, masks, limit, unread = self.read(samples)  # the trainer's reading
        r = torch.tensor(rewards, dtype=torch.float32)  # finite and bounded (rewards.MAX_REWARD)
        shaped = torch.tensor([self._shaped(x, group) for x, group in zip(rewards, samples)])
        varied = (shaped.max(1).values != shaped.min(1).values).tolist()
        claims = {  # (group, sample) whose worker said it ended otherwise than its tokens show
            (i, j)
            for i, group in enumerate(samples)
            for j, s in enumerate(group)
            if s.get("finish") not in (None, ends[i][j])  # None: a worker from before workers said
        }
        refused = claims | unread
        cut = {(i, j) for i, e in enumerate(ends) for j, x in enumerate(e) if x == "length"} | limit  # truncated
        trained = [
            [
                (v or g.zero_variance_groups == "train")  # refill: the batch holds others in their place
                and not (g.mask_truncated and (i, j) in cut)
                and (i, j) not in refused
                for j in range(len(group))
            ]
            for i, (v, group) in enumerate(zip(varied, samples))
        ]
        rows, mine, lengths = [], [], []  # mine: (group, sample) of this rank's rows
        for i, group in enumerate(batch.groups):
            p = self.prompt_ids(group)
            for j, s in enumerate(samples[i]):
                if i % self.world == self.rank:
                    rows.append((p, s["tokens"], s["logprobs"], masks[i][j]))
                    mine.append((i, j))
                m = masks[i][j]
                lengths.append((len(s["tokens"]) if m is None else sum(m), trained[i][j]))
        n = sum(t for _, t in lengths)  # samples trained, over every rank
        tokens = sum(k for k, t in lengths if t)
        adv = grpo.advantages(shaped, g.scale_rewards)[[i for i, _ in mine], [j for _, j in mine]].to(self.device)
        env = self.spec.task.environment
        how = (g.loss_aggregation, env.max_episode_tokens if env else g.max_new_tokens)
        scale = torch.tensor(  # times the ranks, whose gradients are averaged
            [
                self.world * grpo.row_weight(len(c) if m is None else sum(m), n, tokens, *how) * trained[i][j]
                for (i, j), (_, c, _, m) in zip(mine, rows)
            ],
            device=self.device,
        )
        rate = lr.rate(self.version, g, self.spec.steps)  # step `version` makes version + 1
        for pg in self.opt.param_groups:
            pg["lr"] = rate
        prox = self._proximal(rows) if g.updates_per_batch > 1 and n else None
        skipped = None if n else "nothing_to_train"
        total, seen, losses, norms = grpo.Stats(), None, [], []
        for _ in range(g.updates_per_batch if n else 0):
            self.opt.zero_grad(set_to_none=True)
            loss, stats, ranked = self._backward(rows, adv, scale, prox)
            total_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.max_grad_norm)
            norm = float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)
            seen = seen or step_metrics.by_sample(ranked, self.world, g.group_size)
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
            "loss": step_metrics.finite(sum(losses) / max(len(losses), 1)),
            "grad_norm": step_metrics.finite(sum(norms) / max(len(norms), 1)),
            "lr": rate,
            "tokens": sum(k for k, _ in lengths),
            "train_s": time.perf_counter() - t0,
            "skipped": skipped,
            **step_metrics.diagnostics(total),
            **step_metrics.behaviour(batch, seen or {}, claims, unread),
            "zero_variance_groups": 1.0 - sum(varied) / len(varied),
            "groups_varied": sum(varied),
            "refill_groups": len(batch.groups) - g.prompts_per_step,
            "truncated": len(cut) / len(lengths),
            "completion_len_min": min(k for k, _ in lengths),
            "completion_len_max": max(k for k, _ in lengths),
            "behaviour_versions": sorted({res["version"] for res in batch.results.values()}),
            "reward_failed": failed,
            **(step_metrics.episodes(samples, unread, env.trust_worker_rewards) if env is not None else {}),
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
        return grpo.micro_batches(rows, budget) if self.world == 1 else fsdp.micro_batches(rows, budget)

    def _bf16(self) -> bool:
        return self.world == 1 and self.device.type == "cuda"  # the sharded ranks' is FSDP2's policy

    def _backward(
        self, rows: list[grpo.Row], adv: torch.Tensor, scale: torch.Tensor, prox: list[torch.Tensor] | None
    ) -> tuple[float, grpo.Stats, list[tuple[int, tuple[int, float, float, bool]]]]:
        """The gradient of this rank's rows, in micro-batches of `grpo.microBatchTokens` (one pass
        without it); the loss and its stats, over the whole batch (every rank) as one pass gives
        them, and every rank's row stats, as (rank, row stats) in rank order."""
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
            ranked = [(rank, x) for rank, part in enumerate(every) for x in part]
        else:
            ranked = [(0, x) for x in stats.rows]
        return float(self._sum(loss)) / self.world, stats, ranked

    def _sum(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
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
        if isinstance(self.saved, resume.Checkpoints):  # one rank's
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
        assert self.store is not None  # rank 0's, which asks
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
            gather.stream(
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


def follow(spec: JobSpec, state_dir: Path, gang: rendezvous.Gang) -> None:
    """Every rank but 0: the same learner, making each call rank 0 makes. A node's first process
    (before it has joined) makes its node's other ranks, and stops them when rank 0 says stop."""
    learner = Learner(spec, state_dir, gang, dist.get_rank() if dist.is_initialized() else gang.first)
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        method, args = box[0]
        if method == "stop":
            break
        getattr(learner, method)(*args)
    if learner.ranks is not None:
        learner.ranks.stop(lambda: None)  # they heard it too
