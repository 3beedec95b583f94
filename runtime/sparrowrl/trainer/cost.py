"""What a job costs, and the tokens it buys per dollar, from the spec's prices: the trainer's
`trainer.costPerHour`, and each placement's `costPerHour` per worker of it.

Dollars accrue over the training loop's time (the clock of tokens per second, over every trainer
process of the job) at the rate of the moment: the trainer's price plus, for each live worker
(heard from within a lease period), the price of the placement its region names. The ledger
meters it at every change and every report, each interval at the rate seen at its end. Tokens per
dollar are the completion tokens trained on over those dollars."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sparrowrl.spec.job import JobSpec


@dataclass(frozen=True)
class Rates:
    trainer: float  # dollars an hour
    regions: dict[str, float]  # a placement's region → dollars an hour for each live worker in it

    @classmethod
    def of(cls, spec: JobSpec) -> Rates | None:
        """The spec's prices; None where it gives none (then no cost is reported). A placement
        without a price costs nothing, as does a worker of no placement (`topology` regions)."""
        regions = {p.region: p.cost_per_hour for p in spec.placements or [] if p.cost_per_hour is not None}
        if spec.trainer.cost_per_hour is None and not regions:
            return None
        return cls((spec.trainer.cost_per_hour or 0.0) * spec.trainer.nodes, regions)  # a pod per node

    def per_hour(self, live_regions: Iterable[str | None]) -> float:
        """The job's rate while the workers of these regions (one item per worker) are live."""
        return self.trainer + sum(self.regions.get(r, 0.0) for r in live_regions if r is not None)


def accrued(dollars: float, seconds: float, per_hour: float) -> float:
    """`dollars` after `seconds` more at `per_hour`."""
    return dollars + max(0.0, seconds) * per_hour / 3600


@dataclass
class Meter:
    """The job's cost so far, as the clock moves on."""

    rates: Rates
    dollars: float = 0.0
    at: float = 0.0  # the training loop's seconds up to which cost has accrued

    def to(self, seconds: float, live_regions: Iterable[str | None]) -> float:
        """The cost up to `seconds`, the time since the last call at the rate of the workers live now."""
        self.dollars = accrued(self.dollars, seconds - self.at, self.rates.per_hour(live_regions))
        self.at = max(self.at, seconds)
        return self.dollars


MIN_DOLLARS = 1e-6  # below a millionth of a dollar, tokens per dollar says nothing (and may overflow)


def tokens_per_dollar(tokens: int, dollars: float) -> float | None:
    """None until something has cost a millionth of a dollar."""
    return tokens / dollars if dollars >= MIN_DOLLARS else None
