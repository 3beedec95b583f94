"""The base of the job spec's sections. Strict because a misspelt field silently ignored would run
another job than the one written; frozen because one spec is shared by every part of a run."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

Text = Annotated[str, Field(max_length=4096)]


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True, allow_inf_nan=False
    )
