"""`k3-serve-nvidia`: `k3 serve --platform nvidia` with the nvidia plugin's serving defaults.

Refuses (exit 2, the platform's one-sentence reason) when the nvidia platform cannot run here.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from k3.cli.serve import vendor_main

    return vendor_main("nvidia", argv)


if __name__ == "__main__":
    sys.exit(main())
