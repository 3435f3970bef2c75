"""`python -m selfopd ...`: the `selfopd` command, for checkouts without the console script."""

import sys

from selfopd.cli import main

sys.exit(main())
