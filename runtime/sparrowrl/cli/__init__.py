"""The `sparrowrl` command, the local runner behind `sparrowrl run`, and the run's report."""
