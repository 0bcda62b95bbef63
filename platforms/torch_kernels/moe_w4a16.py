"""W4A16 routed experts in pure torch: `moe.experts` for devices with torch but no Triton (the
ppu platform). `k3.plugin.kernels.Experts` is the contract; `k3.reference.experts_forward` is
its oracle. Three ways, chosen per call from what the weights are and what `build_experts`
found the device can do (never by trying):

- **grouped** (dense bf16 experts, the expert cache `k3.engine.expert_cache` or a bf16
  checkpoint, on a device with a sync-free `torch._grouped_mm`): the (token, slot) pairs sorted
  by expert on the device, their activations gathered, two grouped GEMMs over the expert stacks
  (a group per expert; an expert no pair names is never read), the GLU, and the weighted sum by
  `index_add_`. No host read in either dispatch: decode reads the routed experts' bf16 weights
  once (k3-slice, one token: 16 experts x 33M weights x 2 B = 1.06 GB a layer).
- **slots** (`moe_slots.slot_experts`; dense_dispatch=True otherwise): no host read either; each
  expert slot a step can touch runs on every token, masked. MXFP4 experts are dequantised g at
  a time (`mxfp4_lut.lut_dequantize`: 6.5 bytes a weight in two eager passes; where the device
  compiles, one torch.compile'd function, `mxfp4_lut.CompiledDecoder`) into one reused workspace.
- **host** (dense_dispatch=False otherwise: prefill, eager steps): the expert-sorted pairs'
  bounds read on the host once; the experts no pair names are skipped, the others walked g at
  a time (MXFP4 dequantised into the workspace), each on its exact rows (a grouped GEMM over
  the group where the device has it, else one product per expert).

Operands: bf16 activations against MXFP4 or bf16 experts take bf16 operands in every way (an
MXFP4 weight is exact in bf16: a 2-bit mantissa times a power of two), so the MXFP4 ways
dequantise to 2 bytes a weight, not 4, and dense bf16 stacks are never copied to fp32. Every way
then rounds at the same two points: the gate/up and the down products' outputs (fp32
accumulation, bf16 output). The GLU's fp32 output enters the down product split into bf16 hi and
lo rows (`split_products`: one product, the weights read once), not rounded, and the GLU, the
routing weights and the sum over a token's experts stay in the compute dtype (fp32). Anything
else (fp32 / fp64 activations or weights) runs in the compute dtype throughout.

The workspace (`Workspace`) holds one group of w13 and w2 in the operand dtype, never the whole
stack; its buffers are kept for good (a captured decode graph holds their addresses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3 import reference as ref
from k3.dtypes import compute_dtype
from k3.quant.mxfp4 import MXFP4Tensor

from .device_support import compile_supported, grouped_gemm_supported
from .moe_experts import _check_2d
from .moe_slots import Materialiser, slot_experts, sort_pairs
from .mxfp4_lut import CompiledDecoder
from .split_products import interleave_groups, merge_rows

ExpertWeight = torch.Tensor | MXFP4Tensor
WORKSPACE_BYTES = 512 << 20     # bound of one group's dequantised w13 + w2 and its transient indices / activations
INDEX_BYTES = 2                 # the eager table's int32 index a weight (one per two weights), transient
# the grouped way's transient activations at a prefill, bounded (with WORKSPACE_BYTES, inside the capacity
# planner's fixed workspace, k3.cache.capacity.FIXED_WORKSPACE): unbounded, one 8K-token prompt on k3-slice
# (131K (token, choice) rows) asked for ~20 GiB of them and ran out of memory on an H100 (bench/ppu_profile.py)
GROUPED_TRANSIENT_BYTES = 1 << 30


def grouped_rows_max(hidden: int, inter: int, budget: int = GROUPED_TRANSIENT_BYTES) -> int:
    """(token, choice) rows one grouped pass may take within `budget` bytes of transients: a
    row holds, at the peak, its gathered activation, the gate/up product in bf16 and fp32, the
    GLU output and its hi / lo split, the down product of both halves and the fp32 sums that
    merge and weight them, bounded by 24 bytes per hidden plus 24 per intermediate column
    (k3-slice: 157 KiB a row, 6,800 rows a GiB)."""
    return max(1, budget // (24 * (hidden + inter)))


def group_size(num_experts: int, per_expert_bytes: int, budget: int = WORKSPACE_BYTES) -> int:
    """Experts per group: as many as fit `budget` bytes at `per_expert_bytes` each, at least
    one, at most `num_experts`."""
    return max(1, min(num_experts, budget // max(per_expert_bytes, 1)))


@dataclass
class Workspace:
    """One group's dequantised weights, reused across calls: a pair of buffers per (group,
    shape, dtype, device), shared by every MoE layer of a model."""

    buffers: dict = field(default_factory=dict)

    def get(self, g: int, inter: int, hidden: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (g, inter, hidden, dtype, str(device))
        if key not in self.buffers:     # kept for good: a captured graph may hold these addresses
            self.buffers[key] = (torch.empty(g, 2 * inter, hidden, dtype=dtype, device=device),    # [g, 2I, L]
                                 torch.empty(g, hidden, inter, dtype=dtype, device=device))        # [g, L, I]
        return self.buffers[key]


def operand_dtype(x_dtype: torch.dtype, w13: "ExpertWeight", w2: "ExpertWeight", compute: torch.dtype) -> torch.dtype:
    """The products' operand dtype (module docstring): bf16 for bf16 activations when every
    weight is MXFP4 or bf16 (each exact in bf16), else the compute dtype."""
    exact = all(isinstance(w, MXFP4Tensor) or w.dtype == torch.bfloat16 for w in (w13, w2))
    return torch.bfloat16 if x_dtype == torch.bfloat16 and exact else compute


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows [offs[i-1], offs[i]) of a [M, in] times w[i]^T (w [G, out, in]); rows past offs[-1]
    are left unwritten (the caller masks them)."""
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


class W4A16Experts:
    """The `moe.experts` entry for one device (module docstring); `grouped` and `compiled`
    (torch.compile fuses the GLU and the MXFP4 dequantisation) are what `build_experts` decided
    for it."""

    def __init__(self, *, grouped: bool, compiled: bool, workspace_bytes: int = WORKSPACE_BYTES,
                 grouped_transient_bytes: int = GROUPED_TRANSIENT_BYTES):
        self.grouped = grouped
        self.compiled = compiled
        self.workspace_bytes = workspace_bytes
        self.grouped_transient_bytes = grouped_transient_bytes
        self.workspace = Workspace()
        self._glu_fn = torch.compile(ref.glu_activation, dynamic=True) if compiled else ref.glu_activation
        # MXFP4 dequantisation by one compiled function where the device compiles
        self._lookup = CompiledDecoder() if compiled else None

    def way(self, w13: ExpertWeight, w2: ExpertWeight, x_dtype: torch.dtype, dense_dispatch: bool) -> str:
        """"grouped", "slots" or "host": which way a call with these weights and activations of
        `x_dtype` takes (grouped: bf16 activations against dense bf16 stacks)."""
        dense = isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)
        if dense and self.grouped and x_dtype == w13.dtype == w2.dtype == torch.bfloat16 \
                and w13.shape[2] % 8 == 0 and w2.shape[2] % 8 == 0:
            return "grouped"
        return "slots" if dense_dispatch else "host"

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
        out = torch.zeros(t, hidden, dtype=cd, device=x.device)
        if topk_ids.numel() == 0:
            return out.to(x.dtype)
        od = operand_dtype(x.dtype, w13, w2, cd)
        xf, weights = x.to(od), topk_weights.to(cd)                           # [T, L] operands, [T, k]
        local = topk_ids.long() - expert_start                                 # [T, k] local ids
        glu = self._glu(activation, beta, linear_beta)
        way = self.way(w13, w2, x.dtype, dense_dispatch)
        if way == "grouped":
            return self._grouped(x, w13, w2, local, weights, out, glu, dense_dispatch).to(x.dtype)
        mxfp4 = isinstance(w13, MXFP4Tensor) or isinstance(w2, MXFP4Tensor)
        # experts the workspace holds (their weights, and the eager table's transient indices: the
        # compiled decoder stores none), the same for every call of a shape (one pair of
        # buffers); the slots also bound a group's activations [g, T, 3I]
        index_bytes = INDEX_BYTES if self._lookup is None else 0
        g = group_size(e_local, 3 * inter * hidden * (od.itemsize + index_bytes), self.workspace_bytes)
        gathered = mxfp4 or (way == "slots" and t * topk_ids.shape[1] < e_local)   # weights copied per call
        ws13, ws2 = self.workspace.get(g, inter, hidden, od, x.device) if gathered else (None, None)
        m13, m2 = Materialiser(w13, ws13, od, self._lookup), Materialiser(w2, ws2, od, self._lookup)
        if way == "host":
            return self._host(xf, m13, m2, local, weights, out, glu, g=g, e_local=e_local, mxfp4=mxfp4).to(x.dtype)
        g_act = group_size(e_local, t * 3 * inter * cd.itemsize, self.workspace_bytes)
        g = min(g, g_act) if gathered else g_act
        return slot_experts(xf, local, weights, out, e_local=e_local, g=g, w13=m13, w2=m2, glu=glu).to(x.dtype)

    def _glu(self, activation, beta, linear_beta):
        return lambda h: self._glu_fn(h, activation=activation, beta=beta, linear_beta=linear_beta)

    def _grouped(self, x, w13, w2, local, weights, out, glu, dense_dispatch):
        """Dense bf16 stacks, one grouped GEMM each over the expert-sorted pairs. Decode
        (dense_dispatch) and batches of up to `grouped_rows_max` (token, choice) rows (within
        `grouped_transient_bytes`) run in one pass with no host read; a larger prefill reads the
        experts' row bounds on the host once and runs `_grouped_rows` on consecutive runs of at
        most that many sorted rows, so its transient activations stay bounded (an expert whose
        rows straddle two runs is read twice)."""
        k = local.shape[1]
        order, counts = sort_pairs(local.reshape(-1), w13.shape[0])               # counts [E + 1]: last = others'
        rows_max = grouped_rows_max(w13.shape[2], w13.shape[1] // 2, self.grouped_transient_bytes)
        if dense_dispatch or order.numel() <= rows_max:
            return self._grouped_rows(x, w13, w2, order, counts, k, weights, out, glu)
        ends = counts[:-1].cumsum(0)                                               # [E] end row of each expert
        live = int(ends[-1])                                                        # one host read (prefill)
        for r0 in range(0, live, rows_max):
            r1 = min(live, r0 + rows_max)
            run_ends = (ends - r0).clamp(0, r1 - r0)                                # [E] within this run
            # [E + 1]: each expert's rows in this run, then 0 other ranks' rows (runs end at `live`)
            run_counts = torch.diff(run_ends, prepend=run_ends.new_zeros(1), append=run_ends[-1:])
            self._grouped_rows(x, w13, w2, order[r0:r1], run_counts, k, weights, out, glu)
        return out

    @staticmethod
    def _grouped_rows(x, w13, w2, order, counts, k, weights, out, glu):
        """`out` += the pairs `order` ([M] (token, choice) indices sorted by expert; counts [E + 1]
        the rows of each expert, then the other ranks' rows, which are masked) through the
        grouped GEMMs. The products take bf16 operands with fp32 accumulation and round their
        outputs to bf16 (torch._grouped_mm returns its operands' dtype); the down product takes
        the activation split (hi / lo rows, offsets doubled); the GLU, the routing weights and
        the sum over a token's experts stay in `out`'s dtype (fp32)."""
        offs = counts[:-1].cumsum(0).to(torch.int32)                              # [E] end row of each expert
        tok = order // k                                                           # [M] each row's token
        h = glu(_grouped_mm(x[tok], w13, offs).to(out.dtype))                     # [M, I]
        rows, hi_pos, lo_pos = interleave_groups(h, counts)                       # [2M, I] bf16
        o = merge_rows(_grouped_mm(rows, w2, 2 * offs), hi_pos, lo_pos, out.dtype)   # [M, L]
        live = torch.arange(o.shape[0], device=o.device) < offs[-1]                # rows of this rank's experts
        return out.index_add_(0, tok, torch.where(live[:, None], o * weights.reshape(-1)[order, None], 0))

    def _host(self, xf, m13, m2, local, weights, out, glu, *, g, e_local, mxfp4):
        """Host dispatch: the expert-sorted pairs' bounds read once; used experts only, g at a
        time, each on its exact rows. xf holds the operands; products are taken to `out`'s dtype
        for the GLU and the sum."""
        k = local.shape[1]
        order, counts = sort_pairs(local.reshape(-1), e_local)
        bounds = [0] + counts[:-1].cumsum(0).tolist()                              # one host read
        used = [e for e in range(e_local) if bounds[e + 1] > bounds[e]]
        tok, weight = order // k, weights.reshape(-1)[order]                      # [M], [M]
        step = g if mxfp4 else max(1, len(used))                                  # dense: every used expert at once
        for c0 in range(0, len(used), step):
            chunk = used[c0:c0 + step]
            r0, r1 = bounds[chunk[0]], bounds[chunk[-1] + 1]
            rows = [bounds[e + 1] - bounds[e] for e in chunk]                      # each expert's rows, in order
            a = xf[tok[r0:r1]]                                                     # [r, L]
            if mxfp4:
                consecutive = chunk[-1] - chunk[0] == len(chunk) - 1
                index = None if consecutive else torch.tensor(chunk, device=xf.device)
                w13g, w2g = m13(chunk[0], chunk[0] + len(chunk), index), m2(chunk[0], chunk[0] + len(chunk), index)
                h = glu(self._products(a, w13g, rows).to(out.dtype))
                o = self._down(h, a.dtype, rows, lambda r, n: self._products(r, w2g, n))
            else:                                                                  # dense stacks read in place
                h = glu(_per_expert(a, m13.w, chunk, rows, m13.dtype).to(out.dtype))
                o = self._down(h, a.dtype, rows, lambda r, n: _per_expert(r, m2.w, chunk, n, m2.dtype))
            out.index_add_(0, tok[r0:r1], o * weight[r0:r1, None])
        return out

    @staticmethod
    def _down(h: torch.Tensor, operand: torch.dtype, rows: list[int], product) -> torch.Tensor:
        """The down product of the GLU output h [r, I] (rows[i] rows of expert i in turn) in h's
        dtype: `product(a, rows)` on h itself, or on bf16 operands on its hi / lo split."""
        if operand == h.dtype:
            return product(h, rows)
        split, hi_pos, lo_pos = interleave_groups(h, torch.tensor(rows, device=h.device))
        return merge_rows(product(split, [2 * n for n in rows]), hi_pos, lo_pos, h.dtype)

    def _products(self, a: torch.Tensor, w: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """a [r, in] (rows[i] rows of expert i in turn) times each expert's w[i]^T ([out, in])."""
        if self.grouped and a.dtype == torch.bfloat16 and a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0:
            offs = torch.tensor(rows, device=a.device).cumsum(0).to(torch.int32)
            return _grouped_mm(a, w, offs)
        return _per_expert(a, w, range(len(rows)), rows, a.dtype)


def _per_expert(a: torch.Tensor, w: torch.Tensor, experts, rows: list[int], dtype: torch.dtype) -> torch.Tensor:
    """a [r, in] times w[e]^T for the experts in turn, rows[i] rows each (w read in place)."""
    out = a.new_empty(a.shape[0], w.shape[1])
    r0 = 0
    for e, n in zip(experts, rows):
        torch.matmul(a[r0:r0 + n], w[e].to(dtype).T, out=out[r0:r0 + n])
        r0 += n
    return out


def build_experts(device: str, *, workspace_bytes: int = WORKSPACE_BYTES) -> W4A16Experts:
    """The entry for `device` ("cuda", "cpu", ...), with grouped GEMM and the compiled GLU where
    the device supports them (decided here, once)."""
    return W4A16Experts(grouped=grouped_gemm_supported(device), compiled=compile_supported(device),
                        workspace_bytes=workspace_bytes)
