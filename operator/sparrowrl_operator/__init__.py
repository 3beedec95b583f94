"""The SparrowRL operator: SparrowRLJob and SparrowCluster custom resources reconciled into the
trainer, relays and rollout workers of `sparrowrl.layout.processes`, spread over member clusters."""
