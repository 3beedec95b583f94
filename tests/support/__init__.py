"""The tests' harness: emulated clusters and their kubelet (kube, kubelet, operator_run), servers
and bounded children (servers, bounded), and network faults (netfaults). No test lives here."""
