"""What one forward call reads: flat batch metadata and the cache tensors it addresses.

A batch packs N sequences' new tokens along one axis. Sequence n contributes q_len_n tokens
that continue from context_len_n tokens already in the cache (0 for a fresh prompt). The KDA
state of a sequence lives in state slot `state_slots[n]`; its MLA latents (and DSA index keys)
live in the pages listed in `block_table[n]`. Everything is a tensor so the engine can build
it without per-request Python objects and a decode step can be captured as a graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """Flat metadata of one forward call (N sequences, T tokens).

    input_ids:    [T] int64, the new tokens of every sequence, packed in sequence order.
    positions:    [T] int64, each token's position in its sequence.
    cu_seqlens:   [N+1] int32, boundaries of the sequences in the packed axis.
    context_lens: [N] int64, tokens already cached before this call (0: fresh state).
    state_slots:  [N] int64, KDA state slot of each sequence.
    block_table:  [N, max_pages] int32, latent / index-key pages of each sequence.
    logits_indices: [M] int64 token indices to compute logits for (default: each sequence's
        last token).
    max_q_len:    host int, the most new tokens any sequence brings (1: a pure decode step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    state_slots: torch.Tensor
    block_table: torch.Tensor
    logits_indices: torch.Tensor
    max_q_len: int

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

    @classmethod
    def build(
        cls,
        new_tokens: Sequence[Sequence[int]],
        *,
        context_lens: Sequence[int],
        state_slots: Sequence[int],
        block_table: torch.Tensor,
        all_logits: bool = False,
        device=None,
    ) -> "ForwardBatch":
        """Metadata for N sequences from Python lists (tests, `k3 generate`).

        all_logits: logits for every token (teacher forcing) instead of each last token.
        """
        lens = [len(t) for t in new_tokens]
        if any(n == 0 for n in lens):
            raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
        ids = torch.tensor([t for seq in new_tokens for t in seq], dtype=torch.long, device=device)
        positions = torch.tensor([c + i for c, n in zip(context_lens, lens) for i in range(n)],
                                 dtype=torch.long, device=device)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.tensor(lens, device=device).cumsum(0)
        last = cu[1:].long() - 1
        return cls(
            input_ids=ids,
            positions=positions,
            cu_seqlens=cu,
            context_lens=torch.tensor(list(context_lens), dtype=torch.long, device=device),
            state_slots=torch.tensor(list(state_slots), dtype=torch.long, device=device),
            block_table=block_table.to(device=device, dtype=torch.int32),
            logits_indices=torch.arange(ids.shape[0], device=device) if all_logits else last,
            max_q_len=max(lens),
        )


@dataclass
class ModelCache:
    """This rank's cache tensors (the engine owns and addresses them; the model reads/writes).

    kda_state:   [n_kda_layers, num_slots, H_local, K, V] fp32 (fp64 for a float64 model),
                 the canonical KDA layout.
    conv_state:  [n_kda_layers, num_slots, 3 * H_local * K, W - 1] activation dtype: the last
                 W-1 pre-conv inputs of the q, k and v channels, oldest first.
    latent:      [n_mla_layers, num_pages, page_size, R + Dr] activation dtype ([c | k_pe]).
    index_values / index_scales: DSA index keys, [n_mla_layers, num_pages, page_size, D]
                 float8_e4m3fn and [n_mla_layers, num_pages, page_size] fp32; None without DSA.
    """

    kda_state: torch.Tensor
    conv_state: torch.Tensor
    latent: torch.Tensor
    index_values: torch.Tensor | None
    index_scales: torch.Tensor | None

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zero the KDA state of `slots` (a fresh sequence starts from zero state)."""
        self.kda_state[:, slots] = 0
        self.conv_state[:, slots] = 0


def contiguous_block_table(num_seqs: int, pages_per_seq: int, device=None) -> torch.Tensor:
    """Block table giving sequence n the pages [n * pages_per_seq, (n + 1) * pages_per_seq)."""
    return torch.arange(num_seqs * pages_per_seq, dtype=torch.int32, device=device).reshape(num_seqs, pages_per_seq)
