"""W4A16 routed experts in pure torch: `moe.experts` for devices with torch but no Triton (the
ppu platform). `k3.plugin.kernels.Experts` is the contract; `k3.reference.experts_forward` is
its oracle.

The (token, slot) pairs are sorted by local expert on the device (a stable argsort; the pairs of
other ranks' experts go to a sentinel bucket at the end), so each expert's tokens are one
contiguous run of rows. The experts are then walked in groups: a group's MXFP4 weights are
dequantised into a workspace reused by every call (`Workspace`: one group of w13 and w2 in the
compute dtype, never the whole expert stack), and its rows run as one grouped GEMM
(`torch._grouped_mm`, where `grouped_gemm_supported` says the device has it) or a loop over the
group's experts, then the GLU, the second grouped GEMM, and the routing-weighted sum
(`index_add_`).

- dense_dispatch=False reads the per-group row counts on the host once and skips the groups
  no token reaches (prefill, eager decode).
- dense_dispatch=True never synchronises (decode, graph capture). With fewer pairs than local
  experts (a few decode tokens) each pair's own expert is dequantised, found on the device, and
  applied as a batched matrix-vector product: only the experts the routing names are read.
  Otherwise every group is dequantised, and its rows are found by rotating the sorted pairs by
  the group's start row on the device (a gather), with the rows past the group's last expert
  masked out of the sum.

`build_experts(device)` decides once, at set-up, what the device supports (grouped GEMM, a
compiled GLU) and returns the entry; nothing is probed per call. Dense (unquantised) weights
take the same path with `w[e]` copied into the workspace. The activation is
`k3.reference.glu_activation` (compiled with `torch.compile` when `compile_supported` holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype
from k3.quant.mxfp4 import MXFP4_BLOCK, MXFP4Tensor, mxfp4_dequantize

from .moe_experts import _check_2d
from .device_support import compile_supported, grouped_gemm_supported

ExpertWeight = torch.Tensor | MXFP4Tensor
WORKSPACE_BYTES = 256 << 20     # bound of one group's dequantised w13 + w2 (at least one expert)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def group_size(num_experts: int, inter: int, hidden: int, itemsize: int, budget: int = WORKSPACE_BYTES) -> int:
    """Experts per group: as many as fit `budget` bytes of w13 + w2 (3 I L elements each), at
    least one, at most `num_experts`."""
    per_expert = 3 * inter * hidden * itemsize
    return max(1, min(num_experts, budget // max(per_expert, 1)))


def _pair_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 2]: a packed byte -> its (low nibble, high nibble) E2M1 values in `dtype`."""
    codes = torch.arange(256)
    values = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)
    return torch.stack([values[codes & 15], values[codes >> 4]], -1).to(dtype).to(device)


@dataclass
class Workspace:
    """One group's dequantised weights, reused across calls (one pair of buffers per dtype,
    device and shape: every MoE layer of a model shares one), plus the decode tables of the
    dequantisation (built on first use, before any graph capture)."""

    buffers: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)

    def get(self, g: int, inter: int, hidden: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (g, inter, hidden, dtype, str(device))
        if key not in self.buffers:     # kept for good: a captured graph may hold these addresses
            self.buffers[key] = (torch.empty(g, 2 * inter, hidden, dtype=dtype, device=device),
                                 torch.empty(g, hidden, inter, dtype=dtype, device=device))
        return self.buffers[key]

    def table(self, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (dtype, str(device))
        if key not in self.tables:
            scale = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")], dtype=torch.float64)
            self.tables[key] = (_pair_table(dtype, device), scale.to(dtype).to(device))
        return self.tables[key]


def dequantize_into(out: torch.Tensor, w: ExpertWeight, e0: int, e1: int, ws: Workspace,
                    index: torch.Tensor | None = None) -> torch.Tensor:
    """Experts e0..e1 of `w` (or, with `index`, the experts it lists, a device tensor: no host
    read) written densely into out[:n] (returned). MXFP4 bytes are decoded through a 256-entry
    pair table straight into the workspace, then scaled in place; exact (what
    `mxfp4_dequantize` gives) in bf16 / fp32 / fp64. fp16 goes through fp32."""
    sel = slice(e0, e1) if index is None else index
    n = e1 - e0 if index is None else index.shape[0]
    dst = out[:n]
    if not isinstance(w, MXFP4Tensor):
        return dst.copy_(w[sel])
    packed, scales = w.packed[sel], w.scales[sel]
    if dst.dtype not in (torch.bfloat16, torch.float32, torch.float64):
        return dst.copy_(mxfp4_dequantize(packed, scales, dtype=torch.float32))
    pairs, scale = ws.table(dst.dtype, dst.device)
    for i in range(n):                       # one expert's int32 byte index at a time
        torch.index_select(pairs, 0, packed[i].reshape(-1).int(), out=dst[i].view(-1, 2))
        blocks = dst[i].view(dst.shape[1], -1, MXFP4_BLOCK)
        blocks.mul_(scale[scales[i].long()].unsqueeze(-1))
    return dst


def _grouped_torch(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows [offs[i-1], offs[i]) of a [M, in] times w[i]^T ([out, in]); other rows zero. No host
    synchronisation (a masked product per expert)."""
    rows = torch.arange(a.shape[0], device=a.device)
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    out = a.new_zeros(a.shape[0], w.shape[1])
    for i in range(w.shape[0]):
        mine = ((rows >= starts[i]) & (rows < offs[i]))[:, None]
        out = torch.where(mine, a @ w[i].T, out)
    return out


def _grouped_sliced(a: torch.Tensor, w: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """`_grouped_torch` with the group's row bounds known on the host: one exact product per
    expert (host dispatch)."""
    out = a.new_empty(a.shape[0], w.shape[1])
    for i, (r0, r1) in enumerate(zip(bounds[:-1], bounds[1:])):
        if r1 > r0:
            torch.matmul(a[r0:r1], w[i].T, out=out[r0:r1])
    return out


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The same product as `_grouped_torch` on torch._grouped_mm (rows past offs[-1] zeroed)."""
    out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs.int())
    return torch.where((torch.arange(a.shape[0], device=a.device) < offs[-1])[:, None], out, 0)


class W4A16Experts:
    """The `moe.experts` entry for one device (see the module docstring); `grouped` and `glu`
    are what `build_experts` decided for it."""

    def __init__(self, *, grouped: bool, compiled_glu: bool, workspace_bytes: int = WORKSPACE_BYTES):
        self.grouped = grouped
        self.compiled_glu = compiled_glu
        self.workspace_bytes = workspace_bytes
        self.workspace = Workspace()
        self._glu = torch.compile(ref.glu_activation, dynamic=True) if compiled_glu else ref.glu_activation

    def _gemm(self, a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
        """The group's product: grouped GEMM where set up and the shapes allow it, else exact
        per-expert slices (host bounds known) or masked products (device dispatch)."""
        if self.grouped and a.dtype == torch.bfloat16 and a.shape[1] % 16 == 0 and w.shape[1] % 16 == 0:
            return _grouped_mm(a, w, offs)
        return _grouped_torch(a, w, offs) if bounds is None else _grouped_sliced(a, w, bounds)

    def __call__(self, x, w13, w2, topk_weights, topk_ids, *, activation, beta=None, linear_beta=None,
                 expert_start=0, dense_dispatch=False):
        """`Experts` (the module docstring)."""
        fn = "moe_w4a16"
        _check_2d(fn, "x", x, (None, None))
        t, hidden = x.shape
        if len(w13.shape) != 3 or w13.shape[2] != hidden or w13.shape[1] % 2:
            raise ValueError(f"{fn}: w13 must be [E_local, 2I, {hidden}], got {tuple(w13.shape)}")
        e_local, inter = w13.shape[0], w13.shape[1] // 2
        if tuple(w2.shape) != (e_local, hidden, inter):
            raise ValueError(f"{fn}: w2 must be [{e_local}, {hidden}, {inter}], got {tuple(w2.shape)}")
        _check_2d(fn, "topk_weights", topk_weights, (t, None))
        if tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_ids.is_floating_point():
            raise ValueError(f"{fn}: topk_ids must be an int tensor [{t}, k] like topk_weights, got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
        cd = compute_dtype(x, *[w for w in (w13, w2) if isinstance(w, torch.Tensor)])
        dev = x.device
        out = torch.zeros(t, hidden, dtype=cd, device=dev)
        m = topk_ids.numel()
        if m == 0:
            return out.to(x.dtype)
        xf = x.to(cd)
        local = topk_ids.long().reshape(-1) - expert_start                       # [M]
        key = torch.where((local >= 0) & (local < e_local), local, e_local)    # sentinel: not this rank's
        order = torch.argsort(key, stable=True)                                  # [M] pairs by expert
        tok = order // topk_ids.shape[1]                                         # [M] their tokens
        weight = topk_weights.reshape(-1).to(cd)[order]                          # [M]
        counts = torch.zeros(e_local + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
        ends = counts.cumsum(0)[:e_local]                                        # [E] end row per expert
        g = group_size(e_local, inter, hidden, torch.finfo(cd).bits // 8, self.workspace_bytes)
        ws13, ws2 = self.workspace.get(g, inter, hidden, cd, dev)
        groups = [(e0, min(e0 + g, e_local)) for e0 in range(0, e_local, g)]
        if not dense_dispatch:
            bounds = torch.cat([ends.new_zeros(1), ends]).tolist()               # one host read
        if dense_dispatch and m < e_local:
            return self._per_pair(xf, w13, w2, local, topk_weights.reshape(-1).to(cd), topk_ids.shape[1], out,
                                  g, (ws13, ws2), activation, beta, linear_beta).to(x.dtype)
        rows = torch.arange(m, device=dev)
        for e0, e1 in groups:
            if dense_dispatch:
                start = ends[e0] - counts[e0]
                pick = (rows + start) % m                                        # the group's rows first
                offs, local_bounds = ends[e0:e1] - start, None
            else:
                r0, r1 = bounds[e0], bounds[e1]
                if r1 == r0:
                    continue                                                     # no token reaches the group
                pick = rows[r0:r1]
                offs = ends[e0:e1] - r0
                local_bounds = [b - r0 for b in bounds[e0:e1 + 1]]
            w13g = dequantize_into(ws13, w13, e0, e1, self.workspace)
            w2g = dequantize_into(ws2, w2, e0, e1, self.workspace)
            a = xf[tok[pick]]                                                    # [m_g, L]
            h = self._glu(self._gemm(a, w13g, offs, local_bounds), activation=activation, beta=beta,
                          linear_beta=linear_beta)
            o = self._gemm(h, w2g, offs, local_bounds)                                         # [m_g, L]
            live = torch.arange(pick.shape[0], device=dev) < offs[-1]
            out.index_add_(0, tok[pick], torch.where(live[:, None], o * weight[pick, None], 0))
        return out.to(x.dtype)


    def _per_pair(self, xf, w13, w2, local, weight, k, out, g, ws, activation, beta, linear_beta):
        """Device dispatch with fewer (token, slot) pairs than local experts (decode of a few
        tokens): each pair's expert, found on the device, is dequantised (g at a time into the
        workspace) and applied to its token as a batched matrix-vector product, so only the
        experts the pairs name are read; pairs of other ranks' experts weigh 0."""
        m, e_local = local.shape[0], w13.shape[0]
        valid = (local >= 0) & (local < e_local)
        expert = local.clamp(0, e_local - 1)
        tok = torch.arange(m, device=xf.device) // k
        for c0 in range(0, m, g):
            c1 = min(m, c0 + g)
            w13g = dequantize_into(ws[0], w13, 0, 0, self.workspace, index=expert[c0:c1])
            w2g = dequantize_into(ws[1], w2, 0, 0, self.workspace, index=expert[c0:c1])
            a = xf[tok[c0:c1]]                                                       # [n, L]
            h = torch.bmm(w13g, a[:, :, None])[..., 0]                               # [n, 2I]
            h = self._glu(h, activation=activation, beta=beta, linear_beta=linear_beta)
            o = torch.bmm(w2g, h[:, :, None])[..., 0]                                # [n, L]
            out.index_add_(0, tok[c0:c1], torch.where(valid[c0:c1, None], o * weight[c0:c1, None], 0))
        return out


def build_experts(device: str, *, workspace_bytes: int = WORKSPACE_BYTES) -> W4A16Experts:
    """The entry for `device` ("cuda", "cpu", ...), with grouped GEMM and the compiled GLU where
    the device supports them (decided here, once)."""
    return W4A16Experts(grouped=grouped_gemm_supported(device), compiled_glu=compile_supported(device),
                        workspace_bytes=workspace_bytes)
