"""Who may do what: the trainer's Ed25519 signatures on every version, and the per-role tokens
minted from the job's secret. Torch-free: the operator mints tokens for each member cluster."""
