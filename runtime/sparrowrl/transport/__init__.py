"""Moving deltas: an aiohttp server that publishes a checkpoint store, a client that pulls
versions over several parallel Range streams, verifying each piece and resuming after faults,
the regional relay built of both, and the Prometheus metrics every role serves."""
