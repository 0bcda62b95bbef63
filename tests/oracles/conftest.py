"""The oracle tier (marker `oracle`): k3's model against implementations k3 did not write, run
in the peer venv. The helper modules beside the tests (the oracles' own code) import by name
under any pytest import mode."""

import os
import sys
from pathlib import Path

# Triton picks the interpreter when a function is decorated, and triton.language's own helpers
# are decorated when triton is first imported (transformers and compressed-tensors import it):
# vLLM's kernels in the vLLM oracle run under the interpreter, so it must be on before that.
os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).parent))
