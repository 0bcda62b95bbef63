"""Print one of the README's two leading commands (`main` or `test`), so CI runs exactly them."""

import re
import sys
from pathlib import Path

blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", Path(__file__).resolve().parents[1].joinpath("README.md").read_text(), re.S)
if len(blocks) < 2:
    sys.exit("README.md must start with two bash blocks: the main command and the test command")
which = {"main": 0, "test": 1}[sys.argv[1]]
print(blocks[which].strip())
