"""`python -m k3 ...` is the `k3` command (for environments where the script is not on PATH)."""

import sys

from k3.cli.main import main

sys.exit(main())
