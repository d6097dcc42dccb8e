"""`python -m autosched` runs the command line."""

import sys

from autosched.cli import main

sys.exit(main())
