"""`python -m flows.cli`: the `lanebench` command without the installed script."""

import sys

from flows.cli import main

sys.exit(main())
