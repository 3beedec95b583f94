"""Moving deltas: an aiohttp server that publishes a checkpoint store, and a client that pulls
versions over several parallel Range streams, verifying each piece and resuming after faults."""
