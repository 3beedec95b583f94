"""Rollout work: leases, admission under the staleness bound, and how a batch is split across
workers of unequal speed. Pure decisions on an injected clock; the trainer serves them."""
