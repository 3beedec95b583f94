"""The job's `grpo`: the objective, the optimizer and the sampling settings of the policy's rollouts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from sparrowrl.spec.messages import MAX_STOP_CHARS, MAX_STOPS, MAX_TOP_K
from sparrowrl.spec.section import Section


class BehaviourSpec(Section):
    """The behaviour weight w = π_prox/μ: the trainer's policy before the step over the policy
    the worker sampled with (stale, another engine's kernels, or a worker's false numbers)."""

    correction: Literal["off", "truncate", "mask"] = Field(
        "truncate",
        description=(
            "truncate: w clamped to [floor, cap] (TIS; TRL's *_truncate, verl's rollout_is); mask: w outside "
            "[floor, cap] weighs 0 (MIS; TRL's *_mask, verl's rejection sampling); off: w = 1, the samples taken as "
            "the trainer's own (TRL's vllm_importance_sampling_correction: false)."
        ),
    )
    level: Literal["token", "sequence"] = Field(
        "token", description="w per token, or per sample as the geometric mean of its tokens' weights."
    )
    cap: float = Field(2.0, gt=1, le=1e4, description="The upper bound of w (TRL: vllm_importance_sampling_clip_max).")
    floor: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="The lower bound of w, below 1 as cap is above (TRL: vllm_importance_sampling_clip_min).",
    )
    refuse_gap: float = Field(
        1.0,
        gt=0,
        le=1e4,
        description=(
            "A sample whose reported log-probs differ from the trainer's by more than this many nats per token on "
            "average is not trained, and is counted against its worker: more than staleness and engine noise explain."
        ),
    )


class GrpoSpec(Section):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.overlongBuffer) || self.overlongBuffer <= "
                    "(has(self.maxNewTokens) ? self.maxNewTokens : 8)",
                    "message": "overlongBuffer must not exceed maxNewTokens",
                }
            ]
        }
    )
    learning_rate: float = Field(1e-5, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float = Field(1.0, gt=0, le=1e6)
    group_size: int = Field(8, ge=2, le=256)
    prompts_per_step: int = Field(16, ge=1, le=4096)
    clip: float = Field(
        0.2, gt=0, lt=1, description="PPO's clip: r = π_θ/π_prox below 1 − clip stops pulling (TRL: epsilon)."
    )
    clip_high: float | None = Field(
        None,
        gt=0,
        le=10,
        description="r above 1 + clipHigh stops pushing (DAPO's clip-higher; TRL: epsilon_high); default: clip.",
    )
    dual_clip: float | None = Field(
        3.0,
        gt=1,
        le=1e4,
        description=(
            "With a negative advantage, r counts at most this much (dual clip; TRL: delta, verl: clip_ratio_c); "
            "null: no bound."
        ),
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: one ratio per sample, the geometric mean of its tokens' (GSPO; TRL: "
        "importance_sampling_level).",
    )
    loss_aggregation: Literal["token", "sequence", "constant"] = Field(
        "token",
        description=(
            "token: the mean over the batch's tokens (TRL's dapo, verl's token-mean); sequence: each sample's mean, "
            "then their mean (TRL's grpo, verl's seq-mean-token-mean); constant: the sum over samples x "
            "maxNewTokens (Dr. GRPO; TRL's dr_grpo, verl's seq-mean-token-sum-norm)."
        ),
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantages are rewards less their group's mean, divided by the group's std, the batch's, or 1 "
        "(TRL: scale_rewards).",
    )
    zero_variance_groups: Literal["skip", "train", "refill"] = Field(
        "skip",
        description=(
            "A group whose samples all scored alike teaches nothing: skip leaves it out of the step (and its "
            "tokens out of the loss's divisor), counted; train keeps it, as TRL does; refill skips it and has "
            "the step wait for a new group in its place, from new prompts, scored as they are admitted, up to "
            "maxGenBatches (DAPO's dynamic sampling; verl: filter_groups)."
        ),
    )
    max_gen_batches: int = Field(
        3,
        ge=1,
        le=64,
        description=(
            "With zeroVarianceGroups: refill, a step generates at most this many times promptsPerStep groups: "
            "its own and up to (maxGenBatches - 1) x promptsPerStep in place of zero-variance ones; beyond, it "
            "trains on the groups that vary (verl: max_num_gen_batches)."
        ),
    )
    mask_truncated: bool = Field(
        False,
        description=(
            "A completion cut at maxNewTokens (the trainer's reading of its tokens, not the worker's word) is not "
            "trained; its reward still counts in its group's advantages (TRL: mask_truncated_completions)."
        ),
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        le=4096,
        description=(
            "DAPO's overlong shaping: a completion longer than maxNewTokens − overlongBuffer tokens loses "
            "overlongPenalty × (its excess / overlongBuffer) of reward, before advantages (verl: "
            "overlong_buffer.len); 0: none."
        ),
    )
    overlong_penalty: float = Field(
        1.0, gt=0, le=1e6, description="The most reward overlong shaping takes (verl: overlong_buffer.penalty_factor)."
    )
    updates_per_batch: int = Field(
        1,
        ge=1,
        le=64,
        description="Optimizer updates on each batch, clipped against the policy before the first (TRL: "
        "num_iterations, verl: ppo_epochs).",
    )
    behaviour: BehaviourSpec = BehaviourSpec()
    entropy_coef: float = Field(0.0, ge=0, le=10, description="An entropy bonus (verl: entropy_coeff).")
    kl_coef: float = Field(0.0, ge=0, le=100, description="KL to the initial model (TRL: beta).")
    kl_estimator: Literal["k1", "k2", "k3", "low-var-kl"] = Field(
        "k3", description="How the KL is estimated from samples (verl: kl_loss_type kl, mse, k3, low_var_kl)."
    )

    @model_validator(mode="after")
    def _buffer_fits(self) -> GrpoSpec:
        if self.overlong_buffer > self.max_new_tokens:
            raise ValueError(
                f"overlongBuffer ({self.overlong_buffer}) must not exceed maxNewTokens ({self.max_new_tokens})"
            )
        return self

    @property
    def refill_groups(self) -> int:
        """The most groups a step adds in place of zero-variance ones (0: refills off)."""
        return (self.max_gen_batches - 1) * self.prompts_per_step if self.zero_variance_groups == "refill" else 0

    temperature: float = Field(1.0, ge=0.01, le=100)
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens whose probability reaches topP."
    )
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="Sample among the k most likely tokens; 0: all of them.")
    stop: Annotated[
        list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOPS)
    ] = Field(
        [],
        description=(
            "A completion ends at the token that completes one of these strings in its text; that token is kept."
        ),
    )
    max_new_tokens: int = Field(8, ge=1, le=4096)
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 30,
        description=(
            "Token budget of one forward and backward: a rank's rows go in micro-batches of at most this many "
            "padded tokens (rows x (longest prompt + longest completion)), a longer row alone, and their gradients "
            "add up to the one-pass gradient. Default: one pass over the rank's rows."
        ),
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="After the warm-up: constant, or a linear or cosine decay to minLrRatio over the steps."
    )
    warmup_steps: int = Field(
        0, ge=0, le=10_000_000, description="Steps over which the learning rate rises linearly to learningRate."
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="The learning rate at the last step of a linear or cosine decay, over learningRate.",
    )
