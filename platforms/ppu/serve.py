"""`k3-serve-ppu`: `k3 serve --platform ppu` with the ppu plugin's serving defaults.

Refuses (exit 2, the platform's one-sentence reason) when the ppu platform cannot run here.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from k3.cli.serve import vendor_main

    return vendor_main("ppu", argv)


if __name__ == "__main__":
    sys.exit(main())
