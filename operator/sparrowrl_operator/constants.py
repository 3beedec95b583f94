"""Names the operator and its objects share: the API, labels, ports, Event reasons."""

GROUP = "sparrowrl.dev"
VERSION = "v1alpha1"
JOBS = "sparrowrljobs"
CLUSTERS = "sparrowclusters"
FINALIZER = f"{GROUP}/cleanup"
PROGRESS_PREFIX = GROUP  # kopf's annotation progress storage

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "sparrowrl-operator"
JOB_LABEL = f"{GROUP}/job"
UID_LABEL = f"{GROUP}/job-uid"
ROLE_LABEL = f"{GROUP}/role"  # trainer, relay, worker
REGION_LABEL = f"{GROUP}/region"
SLOT_LABEL = f"{GROUP}/slot"  # a worker's index in its placement; a trainer node's index (1..)
NODE_LABEL = f"{GROUP}/trainer-node"  # each pod of a trainer of several nodes: its node's index
METRICS_SCHEME_LABEL = f"{GROUP}/metrics-scheme"  # https: the pod's metrics port serves TLS
ATTEMPT_LABEL = f"{GROUP}/attempt"  # 0 for the first pod of a slot, +1 per replacement
STEPS_ANNOTATION = f"{GROUP}/steps"  # on a trainer pod: the steps of the job document it started with
FAILURES_ANNOTATION = f"{GROUP}/failures-in-a-row"  # on a replacement pod: its slot's failures in a row before it
TOKEN_GENERATION_ANNOTATION = f"{GROUP}/token-generation"  # on a relay or worker pod: its token's generation

TRAINER_PORT = 8470
RENDEZVOUS_PORT = 29500  # where a trainer's nodes meet: node 0's TCP store (torchrun's default)
RELAY_PORT = 8471
WORKER_PORT = 8472
METRICS_PORT = 9090
WORKDIR = "/var/lib/sparrowrl"  # the pods' working folder: job.yaml, state/ and cache/ are mounted in it
TOKEN_KEY = "token"
TRAINER_KEY_KEY = "trainer-key"  # the trainer's public key, beside a relay's or a worker slot's own token
CERT_KEY, KEY_KEY, CA_KEY = (
    "tls.crt",
    "tls.key",
    "ca.crt",
)  # a TLS Secret's keys, as Kubernetes and cert-manager name them
TLS_DIR = "tls"  # where a pod's serving certificate is mounted, in its working folder
CREDENTIALS_DIR = "credentials"  # where a relay's or worker's token (and the job's CA) is mounted

# Event reasons
CREATED = "Created"
CORRECTED = "Corrected"  # an object the operator keeps differed from what it decides, and was applied again
REPLACED = "Replaced"
STALE = "StaleWorker"
UNREACHABLE = "MemberUnreachable"
RECONNECTED = "MemberReconnected"
RESTARTED = "TrainerRestarted"
STEPS_RAISED = "StepsRaised"
INVALID = "InvalidSpec"
SUSPENDED = "Suspended"
RESUMED = "Resumed"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
CLEANED = "Cleaned"
CRASH_LOOP = "CrashLoop"  # a worker or relay slot given up after failures in a row
WORKERS_FAILED = "WorkersFailed"
ADOPTED = "Adopted"  # a state claim retained from an earlier job of the same name
CLAIM_CONFLICT = "StateClaimConflict"
TTL_EXPIRED = "TTLExpired"
RETAINED = "StateRetained"
SAMPLES_REFUSED = "SamplesRefused"  # a worker's samples refused by the trainer: their log-probs were false
STEPS_SKIPPED = "StepsSkipped"  # trainer steps that changed no weight
ISSUED = "CertificateIssued"  # a serving certificate issued anew: a name appeared, it neared its end, or was unfit
UNENCRYPTED = "Unencrypted"  # tls.mode: Disabled
CA_INVALID = "InvalidCA"
