"""The tests' harness: emulated clusters and their kubelet (kube, kubelet, operator_run), servers
and bounded children (servers, bounded), network faults (netfaults), waiting with a deadline
(wait), the tiny job (jobs), test tensors (tensors), models (models) and the rollout engines'
shared checks (engine_contract). No test lives here."""
