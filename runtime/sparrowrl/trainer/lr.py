"""The learning rate of each step: a pure function of the step's index, set on the optimizer
before every step, so a trainer restarted from its checkpoint at step k goes on with the
schedule exactly, with no scheduler state to save."""

from __future__ import annotations

import math

from sparrowrl.spec.grpo import GrpoSpec


def rate(step: int, g: GrpoSpec, steps: int) -> float:
    """The rate of step `step` (0-based) of `steps`: a linear warm-up over `g.warmup_steps` to
    `g.learning_rate` (the first step already takes 1/warmup of it, none takes zero), then
    constant, or a linear or cosine decay that reaches `g.min_lr_ratio` of it at the last step."""
    base = g.learning_rate
    if step < g.warmup_steps:
        return base * (step + 1) / g.warmup_steps
    if g.lr_schedule == "constant":
        return base
    span = steps - 1 - g.warmup_steps
    progress = min(1.0, (step - g.warmup_steps) / span) if span > 0 else 1.0
    left = 1.0 - progress if g.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return base * (g.min_lr_ratio + (1.0 - g.min_lr_ratio) * left)
