"""The oracle tier (marker `oracle`): k3's model against implementations k3 did not write, run
in the peer venv. The helper modules beside the tests (the oracles' own code) import by name
under any pytest import mode."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
