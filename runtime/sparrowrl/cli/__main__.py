"""`python -m sparrowrl.cli`: how the local runner starts each role's process."""

from sparrowrl.cli.main import main

main()
