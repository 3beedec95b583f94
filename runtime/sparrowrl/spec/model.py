"""The job's `model`: the policy trained, from a local folder, the Hugging Face Hub, or a tiny one
made from config."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from sparrowrl.spec.section import Section, Text


class TinyModel(Section):
    """A Qwen3 made from config, with the built-in character tokenizer."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.hidden) || !has(self.heads) || self.hidden % self.heads == 0",
                    "message": "hidden must be a multiple of heads",
                }
            ]
        }
    )
    hidden: int = Field(128, ge=16, le=4096)
    layers: int = Field(2, ge=1, le=64)
    heads: int = Field(4, ge=1, le=64)
    warmup_steps: int = Field(
        0,
        ge=0,
        le=100_000,
        description=(
            "Supervised steps on the task before RL, half of them with a wrong answer: a model that knows the task "
            "but often samples wrongly, where RL post-training starts."
        ),
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        return self


# a repo id on the Hugging Face Hub (huggingface_hub's rules: no "--" or ".." either), and a branch, tag or commit
HUB_REPO = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$"
HUB_REVISION = r"^[A-Za-z0-9_]([A-Za-z0-9._/-]{0,253}[A-Za-z0-9_])?$"


def _hub(pattern: str, what: str, never: tuple[str, ...]) -> AfterValidator:
    def check(name: str) -> str:
        if not re.fullmatch(pattern, name) or any(x in name for x in never):
            raise ValueError(f"{name!r} is not {what}")
        return name

    return AfterValidator(check)


class HubModel(Section):
    """A model on the Hugging Face Hub (or the HF_ENDPOINT's), downloaded by the trainer into its state dir."""

    repo: Annotated[
        str,
        Field(max_length=193, json_schema_extra={"pattern": HUB_REPO}),
        _hub(HUB_REPO, "a repo id, owner/name (letters, digits, '-', '_', '.'; no '--' or '..')", ("--", "..")),
    ] = Field(description="The model's repo id, owner/name.")
    revision: Annotated[
        str,
        Field(max_length=255, json_schema_extra={"pattern": HUB_REVISION}),
        _hub(HUB_REVISION, "a branch, tag or commit (letters, digits, '-', '_', '.', '/'; no '..')", ("..", "//")),
    ] = Field("main", description="A branch, tag or commit of the repo.")


class ModelSpec(Section):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.path) ? 1 : 0) + (has(self.tiny) ? 1 : 0) + (has(self.hub) ? 1 : 0) == 1",
                    "message": "give exactly one of model.path, model.tiny and model.hub",
                },
                {
                    "rule": "!has(self.tiny) || !has(self.tokenizer)",
                    "message": "model.tiny uses the built-in character tokenizer; drop model.tokenizer",
                },
            ]
        }
    )
    path: Text | None = Field(None, description="A local Hugging Face model folder.")
    tiny: TinyModel | None = None
    hub: HubModel | None = Field(
        None,
        description=(
            "A model on the Hugging Face Hub: its config, tokenizer and safetensors weights, downloaded once into "
            "the trainer's state dir (hub/); HF_TOKEN and HF_ENDPOINT are honoured."
        ),
    )
    tokenizer: Text | None = Field(None, description="A tokenizer folder; default: the model's.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if sum(x is not None for x in (self.path, self.tiny, self.hub)) != 1:
            raise ValueError(
                "give exactly one of model.path (a Hugging Face folder), model.tiny and model.hub (a model on the hub)"
            )
        if self.tiny is not None and self.tokenizer is not None:
            raise ValueError("model.tiny uses the built-in character tokenizer; drop model.tokenizer")
        return self
