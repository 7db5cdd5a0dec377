"""`python -m gradacc_ext ...` runs the `gradacc` command."""

import sys

from .cli import main

sys.exit(main())
