"""What one forward call reads: flat forward metadata and the typed cache views.

The engine builds these and the model reads them; kernels never see them (a kernel entry takes
the plain tensors of its protocol in `k3.plugin.kernels`). They only grow. Everything the model
reads per step is a flat tensor (graph capture, XLA static shapes), plus one host integer
(`max_q_len`) that selects the decode or prefill path before tracing. Cache tensors are views:
the core planner owns the row format of the backing tensor and passes each layer's pages as
strided views; kernels never see the row format.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.dtypes import legacy_rounding
from k3.plugin.types import KDA_STATE_LAYOUTS


def leading_one_token_steps(lens: Sequence[int]) -> int:
    """How many sequences at the front of a batch compute one token each (`num_decodes`)."""
    n = 0
    while n < len(lens) and lens[n] == 1:
        n += 1
    return n


class ForwardMode(enum.Enum):
    """What a forward call computes, fixed by the builder (`ForwardMetadata.mode`):
    DECODE  one new token per sequence;
    PREFILL prompt chunks (or a batch whose one-token steps are not ordered first);
    MIXED   one-token steps first (`num_decodes`), then prompt chunks: a layer may run the two
            parts on its decode and prefill paths (`ForwardMetadata.split_decodes`);
    VERIFY  some sequences verify speculative drafts (`ForwardMetadata.spec`)."""

    DECODE = "decode"
    PREFILL = "prefill"
    MIXED = "mixed"
    VERIFY = "verify"


@dataclass
class SpecMetadata:
    """The verifying sequences of a VERIFY call (speculative decoding); at least one sequence
    verifies drafts. A verifying sequence's running KDA state row is left as it was (the
    commit after acceptance writes it).

    lens:          [N] int32, draft tokens each sequence verifies (its q_len is 1 + lens[n];
                   0 = not speculating).
    positions:     [M, 2] int64 or None: (sequence n, token j) of every token of a verifying
                   sequence, made on the host with the batch so the model writes the per-token
                   states or records without reading `lens` back (None: the model derives them
                   from `lens`, at a host synchronisation per layer).
    state_indices: [N, S] int64 (rollback "states"): row t receives the KDA state (every
                   layer, recurrent and conv) after the verifying sequence's token t.
    record_slots:  [N] int64 (rollback "recover"): the slot of `CacheViews.kda_records`
                   receiving the sequence's per-token keys, decays, corrections and pre-conv
                   inputs. Exactly one of state_indices and record_slots is set.
    """

    lens: torch.Tensor
    positions: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    record_slots: torch.Tensor | None = None


@dataclass
class CheckpointMetadata:
    """KDA states saved at chosen positions during the call (prefix caching).

    positions:     [N, C] int64, absolute positions (tokens from the sequence's start) after
                   which the KDA state is also saved, -1 = none.
    state_indices: [N, C] int64, the state rows receiving them.
    """

    positions: torch.Tensor
    state_indices: torch.Tensor

    def rows(self, cut: slice) -> "CheckpointMetadata":
        """The checkpoints of sequences `cut`."""
        return CheckpointMetadata(self.positions[cut], self.state_indices[cut])


@dataclass
class LoRAMetadata:
    """The LoRA adapter of every row of a call (multi-adapter batches, `k3.model.lora`).

    token_slots: [T] int64, the adapter slot of each new token, -1 = the base model.
    seq_slots:   host tuple of N ints, the slot of each sequence (the same per token of it):
                 layers whose weight enters a kernel whole (MLA's kv_b_proj) run each run of
                 sequences sharing an adapter with that adapter's merged weight.
    """

    token_slots: torch.Tensor
    seq_slots: tuple[int, ...]

    def rows(self, cut: slice) -> "LoRAMetadata":
        """The adapters of sequences (and tokens) `cut` of a call whose sequences bring one
        token each up to the cut (`ForwardMetadata.split_decodes`)."""
        return LoRAMetadata(self.token_slots[cut], self.seq_slots[cut])


@dataclass
class ForwardMetadata:
    """Flat metadata of one forward call: N sequences, T new tokens packed in sequence order.

    input_ids:      [T] int64.
    positions:      [T] int64, each token's position in its sequence.
    cu_seqlens:     [N+1] int32, the sequences' boundaries in the packed axis.
    context_lens:   [N] int64, tokens already cached before this call (0: fresh KDA state).
    slot_mapping:   [T] int64, cache slot (page * page_size + offset) where each new token's
                    latent and index key are written. Always a real slot: padding (bucketed
                    shapes) points at a scratch page the planner reserves, never at -1 (a -1
                    would wrap to the last slot of the last page).
    block_table:    [N, max_pages] int32, the sequence's pages in position order, padded with
                    any valid page (reads past seq_lens are masked).
    state_indices:  [N] int64, KDA state row of each sequence.
    logits_indices: [M] int64, tokens whose logits are computed.
    max_q_len:      host int, most new tokens of any sequence.
    num_decodes:    host int: the first num_decodes sequences are decodes (each computes one
                    generated token) and verify no drafts, so a layer runs them on its decode
                    path and the rest, prompt chunks (of one token too), on its prefill path
                    (`split_decodes`); a call is DECODE when every sequence is one. The engine
                    schedules decodes first and a prompt's tokens never take the decode path, so
                    neither a decode's nor a prompt token's arithmetic depends on what shares its
                    batch (issue 32: a one-token prompt chunk, which prefix caching leaves, took
                    the decode path in a crowd and the prefill path alone). Builders of
                    one-token steps that are all decodes set it to N (`build`, decode graphs,
                    the batch-invariant token steps).
    spec:           SpecMetadata, or None when no sequence verifies drafts.
    checkpoints:    CheckpointMetadata, or None when no KDA state is saved mid-call.
    lora:           LoRAMetadata, or None when no row of the call uses a LoRA adapter.
    max_seq_len:    host int or None: the longest sequence after the call (cached + new), where
                    the builder knows it without reading the device (`k3.engine.batch`).
    context_bound:  host int or None: no sequence is longer than this after the call, and a
                    DECODE call's attention and indexer read only this many positions a
                    sequence (`k3.model.paging.bounded_pages`). Set by decode graphs whose
                    runner's kernels cost the table's width (`k3.engine.graphs`), fixed per
                    captured graph; None: the whole block table is read.
    A layer dispatches on `mode`, once.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    state_indices: torch.Tensor
    logits_indices: torch.Tensor
    max_q_len: int
    num_decodes: int = 0
    spec: SpecMetadata | None = None
    checkpoints: CheckpointMetadata | None = None
    lora: LoRAMetadata | None = None
    max_seq_len: int | None = None
    context_bound: int | None = None

    @property
    def mode(self) -> ForwardMode:
        if self.spec is not None:
            return ForwardMode.VERIFY
        if self.max_q_len == 1 and (self.num_decodes == self.num_seqs or legacy_rounding()):
            return ForwardMode.DECODE
        if 0 < self.num_decodes < self.num_seqs:
            return ForwardMode.MIXED
        return ForwardMode.PREFILL

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def q_lens(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()

    @property
    def seq_lens(self) -> torch.Tensor:
        """Context length after this call (cached + new) per sequence."""
        return self.context_lens + self.q_lens

    def split_decodes(self) -> list[tuple[slice, "ForwardMetadata"]]:
        """[(tokens, metadata)] of the first num_decodes sequences (a DECODE part) and of the
        rest (a PREFILL part) of a MIXED call, for a layer that runs them on different paths:
        x[tokens] is a part's input. The decodes bring one token each, so each slice cuts the
        tokens and the sequences alike. A part feeds a layer, not the LM head: its
        logits_indices is empty."""
        d = self.num_decodes
        if self.mode is not ForwardMode.MIXED:
            raise ValueError(f"split_decodes needs a MIXED call: 0 < num_decodes ({d}) < num_seqs ({self.num_seqs}) "
                             f"and no verifying sequence (mode {self.mode.value})")
        ckpt = self.checkpoints
        none = self.logits_indices[:0]

        def part(cut: slice, cu: torch.Tensor, max_q_len: int, decodes: int) -> "ForwardMetadata":
            return ForwardMetadata(
                input_ids=self.input_ids[cut], positions=self.positions[cut], cu_seqlens=cu,
                context_lens=self.context_lens[cut], slot_mapping=self.slot_mapping[cut],
                block_table=self.block_table[cut], state_indices=self.state_indices[cut], logits_indices=none,
                max_q_len=max_q_len, num_decodes=decodes,
                checkpoints=None if ckpt is None else ckpt.rows(cut),
                lora=None if self.lora is None else self.lora.rows(cut))

        head, tail = slice(0, d), slice(d, None)
        return [(head, part(head, self.cu_seqlens[: d + 1], 1, d)),
                (tail, part(tail, self.cu_seqlens[d:] - d, self.max_q_len, 0))]

    def sequences(self, lo: int, hi: int) -> tuple[slice, "ForwardMetadata"]:
        """(tokens, metadata) of sequences lo .. hi - 1 of a call that verifies no drafts, for a
        layer that runs runs of sequences apart (MLA's kv_b_proj under LoRA adapters). Reads
        cu_seqlens on the host. Like a `split_decodes` part, it feeds a layer, not the LM head."""
        if self.spec is not None:
            raise ValueError("ForwardMetadata.sequences: a VERIFY call is not split by sequences")
        bounds = self.cu_seqlens[lo: hi + 1].tolist()
        cut, seqs = slice(bounds[0], bounds[-1]), slice(lo, hi)
        lens = [b - a for a, b in zip(bounds, bounds[1:])]
        ckpt = self.checkpoints
        return cut, ForwardMetadata(
            input_ids=self.input_ids[cut], positions=self.positions[cut],
            cu_seqlens=self.cu_seqlens[lo: hi + 1] - bounds[0], context_lens=self.context_lens[seqs],
            slot_mapping=self.slot_mapping[cut], block_table=self.block_table[seqs],
            state_indices=self.state_indices[seqs], logits_indices=self.logits_indices[:0], max_q_len=max(lens),
            num_decodes=max(0, min(self.num_decodes, hi) - lo), checkpoints=None if ckpt is None else ckpt.rows(seqs),
            lora=None if self.lora is None else LoRAMetadata(self.lora.token_slots[cut], self.lora.seq_slots[seqs]))

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        *,
        context_lens: Sequence[int],
        state_indices: Sequence[int],
        block_table: torch.Tensor,
        page_size: int,
        all_logits: bool = False,
        device=None,
    ) -> "ForwardMetadata":
        """Metadata for N sequences from Python lists (tests, drafts, conformance).

        all_logits: logits for every token (teacher forcing) instead of each last token.
        """
        lens = [len(t) for t in new_tokens]
        if not lens or any(n == 0 for n in lens):
            raise ValueError("ForwardMetadata.build: every sequence needs at least one new token")
        table = block_table.to(device=device, dtype=torch.int32)
        ids = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long, device=device)
        pos = [c + i for c, n in zip(context_lens, lens) for i in range(n)]
        seq = [s for s, n in enumerate(lens) for _ in range(n)]
        positions = torch.tensor(pos, dtype=torch.long, device=device)
        seq_ids = torch.tensor(seq, dtype=torch.long, device=device)
        slots = table[seq_ids, positions // page_size].long() * page_size + positions % page_size
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.tensor(lens, device=device).cumsum(0)
        return cls(
            input_ids=ids, positions=positions, cu_seqlens=cu,
            context_lens=torch.tensor(list(context_lens), dtype=torch.long, device=device),
            slot_mapping=slots, block_table=table,
            state_indices=torch.tensor(list(state_indices), dtype=torch.long, device=device),
            logits_indices=torch.arange(ids.shape[0], device=device) if all_logits else cu[1:].long() - 1,
            max_q_len=max(lens), num_decodes=leading_one_token_steps(lens),
            max_seq_len=max(c + n for c, n in zip(context_lens, lens)),
        )


@dataclass
class LatentCacheView:
    """One MLA layer's latent pages.

    fmt "plain": pages [P, page_size, R + Dr] rows `[c | k_pe]` of dtype bf16 / fp32 / fp64, or
    float8 with `scale` (per-tensor fp32) to dequantise.
    fmt "nvfp4": pages uint8 [P, page_size, R/2 + R/16 + Dr], one `k3.quant.nvfp4_latent`
    record per token, `scale` the global fp32 scale and `kv_lora_rank` R; kernels read them
    dequantised (`k3.model.latent_store.readable_latents`).
    """

    pages: torch.Tensor
    scale: torch.Tensor | None = None
    fmt: str = "plain"
    kv_lora_rank: int = 0

    def __post_init__(self):
        if self.fmt not in ("plain", "nvfp4"):
            raise ValueError(f"unknown latent cache format {self.fmt!r}; known: plain, nvfp4")
        if self.fmt == "nvfp4" and (self.pages.dtype != torch.uint8 or self.scale is None or self.kv_lora_rank < 16):
            raise ValueError("an nvfp4 latent view needs uint8 record pages, a global scale and kv_lora_rank")

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]


@dataclass
class IndexKeyCacheView:
    """One MLA layer's DSA index keys. fmt "fp8": values [P, page_size, D] float8_e4m3fn and
    scales [P, page_size] fp32; fmt "mxfp4": values [P, page_size, D/2] uint8 and scales
    [P, page_size, D/32] uint8 (E8M0)."""

    values: torch.Tensor
    scales: torch.Tensor
    fmt: str = "fp8"


@dataclass
class KDAStateView:
    """One KDA layer's per-sequence state rows.

    recurrent: [num_rows, H_local, K, V] fp32 (fp64 for a float64 model), always indexed in
               the canonical order; `layout` says how a row stores it. "hkv" (canonical): the
               tensor is contiguous per row. "hvk": each head's state is stored transposed
               ([V, K], as some decode kernels want it) and `recurrent` is a transposed,
               strided view of that storage, so generic code (and the reference ops) reads
               and writes it unchanged while a kernel that chose "hvk" uses `stored()`.
    conv:      [num_rows, 3 * H_local * K, W - 1] activation dtype: the last W-1 pre-conv
               inputs of the q, k, v channels, oldest first.
    """

    recurrent: torch.Tensor
    conv: torch.Tensor
    layout: str = "hkv"

    def __post_init__(self):
        if self.layout not in KDA_STATE_LAYOUTS:
            raise ValueError(f"unknown KDA state layout {self.layout!r}; known: {', '.join(KDA_STATE_LAYOUTS)}")

    def stored(self) -> torch.Tensor:
        """The recurrent rows in their storage order: [rows, H, K, V] for "hkv", [rows, H, V, K]
        for "hvk" (row-strided; each row's heads contiguous)."""
        return self.recurrent if self.layout == "hkv" else self.recurrent.transpose(-1, -2)


@dataclass
class KDARecordView:
    """One KDA layer's speculative-verify records (rollback "recover", RecoverSSM-style), per
    record slot and verified token t < L (compute dtype; qkv in the activation dtype):
    keys [slots, L, H_local, K] (L2-normalised), decays [slots, L, H_local, K] (log),
    corrections [slots, L, H_local, V] (beta-scaled), qkv [slots, L, 3 * H_local * K] (pre-conv).
    """

    keys: torch.Tensor
    decays: torch.Tensor
    corrections: torch.Tensor
    qkv: torch.Tensor


@dataclass
class CacheViews:
    """Every layer's view for one rank: `kda[i]` for the i-th KDA layer, `latent[j]` and
    `index_keys[j]` (None without DSA) for the j-th MLA layer; `kda_records[i]` when the
    engine verifies speculative tokens with the "recover" rollback."""

    kda: list[KDAStateView]
    latent: list[LatentCacheView]
    index_keys: list[IndexKeyCacheView] | None
    kda_records: list[KDARecordView] | None = None
