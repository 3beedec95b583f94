"""The learner: fp32 master weights and AdamW, a GRPO step on a complete batch, a checkpoint
after it, and the new bf16 policy's delta streamed into the checkpoint store, where the server
publishes it as it is written (cut-through)."""

from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path

import torch

from sparrowrl import grpo, models, resume, tasks
from sparrowrl.coordinator import Batch
from sparrowrl.delta import state_hash
from sparrowrl.delta.frame import TensorSpec
from sparrowrl.job import JobSpec
from sparrowrl.store import Store


class Learner:
    """The model, its optimizer and the store. Started on a state dir that holds a checkpoint, it
    goes on from there (see resume.py): `version` is the newest version it has trained."""

    def __init__(self, spec: JobSpec, state_dir: Path):
        self.spec, self.state_dir = spec, state_dir
        # processes before this one; `held` keeps a second trainer off the state dir while this one lives
        self.restarts, self.held = resume.claim(state_dir, spec.model_dump(mode="json"))
        torch.manual_seed(spec.seed)
        if spec.model.tiny:
            self.tok = models.char_tokenizer()
            t = spec.model.tiny
            self.model = models.tiny_qwen3(len(self.tok), t.hidden, t.layers, t.heads, spec.seed)
        else:
            self.model, self.tok = models.load(spec.model.path, spec.model.tokenizer)
        self.task, self.reward = tasks.for_job(spec)
        g = spec.grpo
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=g.learning_rate, weight_decay=g.weight_decay)
        self.saved = resume.Checkpoints(state_dir / "trainer")
        newest = self.saved.newest() if self.restarts else None
        if newest is None and spec.model.tiny and spec.model.tiny.warmup_steps:
            models.warm_up(self.model, self.tok, self.task, spec.model.tiny.warmup_steps)
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False) if g.kl_coef > 0 else None  # KL's anchor
        if newest is None:
            if self.ref is not None:
                self.saved.save_ref(self.ref)
            self.version, self.row = 0, None
            self.saved.save(0, self.model, self.opt, None)
        else:
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
            rs = [self.reward(ex.prompt, models.completion_text(self.tok, s["tokens"]), ex.answer)
                  for s in res["samples"]]
            rewards.append(rs)
            for s in res["samples"]:
                rows.append((p, s["tokens"], s["logprobs"]))
                tokens += len(s["tokens"])
        r = torch.tensor(rewards, dtype=torch.float32)
        adv = grpo.advantages(r).flatten()
        ids, attention, positions, mask, behaviour = grpo.pad(rows, self.tok.pad_token_id)
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
        return {"reward_mean": float(r.mean()), "reward_exact": float((r == 1).float().mean()),
                "loss": float(loss.detach()),
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
        with store.publish([TensorSpec.of(n, t) for n, t in new.items()], self.spec.sync.cut_through) as w:
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
