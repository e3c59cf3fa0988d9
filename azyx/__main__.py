"""`python -m azyx`: the `azyx` command (azyx/cli.py)."""

import sys

from azyx.cli import main

sys.exit(main())
