"""`python -m sparrowrl.cli`: how the local runner starts each role's process."""

import sys

from sparrowrl.cli.main import main

sys.exit(main())
