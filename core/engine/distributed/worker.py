"""One launched rank: `python -m k3.engine.distributed.worker ENGINE_CONFIG_JSON DIST_CONFIG_JSON`
with RANK (and the rendezvous variables) in the environment (`launch._start_local` sets them)."""

import json
import os
import sys

from ..config import EngineConfig
from .config import DistributedConfig
from .launch import run_rank


def main() -> int:
    config = EngineConfig(**json.loads(sys.argv[1]))
    if config.graph_batch_sizes is not None:
        config.graph_batch_sizes = tuple(config.graph_batch_sizes)
    return run_rank(config, DistributedConfig(**json.loads(sys.argv[2])), int(os.environ["RANK"]))


if __name__ == "__main__":
    sys.exit(main())
