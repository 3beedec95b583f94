"""The SparrowRL operator: SparrowRLJob and SparrowCluster custom resources reconciled into the
trainer, relays and rollout workers of `sparrowrl.layout.roles`, spread over member clusters."""
