"""`k3-pd-proxy`: the prefill/decode proxy's console script (k3.serve.pd_proxy)."""

from __future__ import annotations

import argparse
import sys

from .parser import K3ArgumentParser


def parser() -> argparse.ArgumentParser:
    p = K3ArgumentParser(prog="k3-pd-proxy", description="OpenAI-compatible proxy in front of prefill "
                                "(kv_producer) and decode (kv_consumer) k3 serve instances (docs/disaggregation.md)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances, http://HOST:PORT")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances, http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="upstream connect / first byte timeout (default 600)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from k3.serve.pd_proxy import build_proxy

    args = parser().parse_args(argv)
    try:
        app = build_proxy(args.prefill, args.decode, timeout_s=args.timeout)
    except ValueError as e:
        print(f"k3-pd-proxy: {e}", file=sys.stderr)
        return 2
    print(f"k3-pd-proxy: prefill {' '.join(args.prefill)} -> decode {' '.join(args.decode)} on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
