"""The distributed runtime: tensor parallelism (TP), data-parallel attention (DP) and the hooks
for expert parallelism (EP), on torch.distributed and torch's elastic launcher.

- `config`: `DistributedConfig`, the layout (DP x TP over nnodes) and its checks.
- `groups`: the process groups (TP, DP leaders, EP, the gloo control group).
- `tp`: a TP leader's step broadcast to its followers (and the follower loop).
- `dp_frontend`: `DistributedEngine`, what rank 0 hands the server (one engine over all DP
  ranks), and the loop of the other DP leaders.
- `launch`: starting the ranks of a node (`start_processes`, what torchrun uses), joining as a
  rank under torchrun, the per-node agent, failure monitoring.

See docs/distributed.md.
"""

from .config import DistributedConfig, DistributedError

__all__ = ["DistributedConfig", "DistributedError"]
