"""Token-sharded prefill: one long prompt's prefill split by tokens over the W ranks of a group.

The prompt is cut into P = 16 contiguous pieces, as even as possible (piece p is tokens
[p T // 16, (p + 1) T // 16), sizes differ by at most one; a prompt shorter than 16 tokens has
empty pieces). Pieces pair up as (p, 15 - p), the causal load balance (an early piece's queries
see few keys, its partner's many), and rank r of W takes the pairs r, r + W, r + 2W, ...: at
W = 8 the pieces r and 15 - r, at W = 4 the pieces {r, 15 - r, r + 4, 11 - r}, at W = 2 eight
pieces, at W = 1 all of them. W must divide 8. The last token (piece 15) is always on rank 0.

Every rank runs the model's own token-wise parts (embedding, AttnRes, norms, projections,
FFN / MoE) on its pieces only (`K3Model.forward` with a stand-in mixer) and:

- MLA: the latent rows `[c | k_pe]` (and the DSA index keys, already quantised) of every
  rank's tokens are all-gathered and written into every rank's cache (`MLAMixer.forward`'s
  `exchange`); each rank then attends with its own pieces' queries, each piece a sequence of
  the call whose context is every token before it. (With the ranks also a TP group, the
  heads <-> tokens re-layout of `k3.model.token_sharded_tp` instead.)
- KDA: the gated delta rule is affine in the state a piece starts from: with S_in the state
  before a piece, every state in it is A_t S_in + B_t and every output o_t = o0_t + S_in^T o'_t
  (A_t [K, K] per head: the product of the transitions (I - beta k k^T) Diag(exp g)). Each
  rank runs the chunked kernel twice over its pieces: once from the zero state (o0, and B =
  the piece's final state) and once with v = 0 from the identity (o' = scale A_t^T q, and A
  = the piece's transition). The 16 (A, B) pairs are all-gathered and every rank chains them
  in token order (S_in(p + 1) = A_p S_in(p) + B_p: 16 small matmuls per head), corrects its
  outputs and writes the final state. The short convolution's window before each piece is the
  last W - 1 pre-conv inputs of the tokens before it: every piece's last W - 1 rows are
  all-gathered, so the window may cross several short or empty pieces.

Afterwards every rank's cache holds what the unsharded prefill writes (the whole prompt's
latents and index keys; the KDA state and conv rows of the prompt), so decode continues on any
one rank unchanged. Exact up to rounding: in float64 the logits and caches equal the unsharded
prefill's to ~1e-12. Cost per KDA layer: twice the chunked recurrence, plus an all-gather of
16 x H x (K x K + K x V) state-sized words and 16 x (W_conv - 1) conv rows; per MLA layer an
all-gather of the prompt's latent rows (R + Dr words a token) and index keys (D fp8 bytes and
one fp32 scale a token). See docs/token-sharded-prefill.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3.model.metadata import CacheViews, ForwardMetadata

from .kda import KDAMixer
from .parallel import Collectives
from .token_sharded_tp import HeadsTokensAttention

NUM_PIECES = 16


def piece_bounds(num_tokens: int, pieces: int = NUM_PIECES) -> list[tuple[int, int]]:
    """[(start, end)] of the `pieces` contiguous token ranges of a prompt, as even as possible."""
    return [(p * num_tokens // pieces, (p + 1) * num_tokens // pieces) for p in range(pieces)]


def rank_pieces(rank: int, world: int, pieces: int = NUM_PIECES) -> list[int]:
    """The pieces rank `rank` of `world` prefills, ascending: the pairs (p, pieces - 1 - p) for
    p = rank, rank + world, ... (world must divide pieces / 2)."""
    pairs = pieces // 2
    if world < 1 or pairs % world:
        raise ValueError(f"token-sharded prefill needs a world size dividing {pairs} (1, 2, 4 or 8 for "
                         f"{pieces} pieces); got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    return sorted(q for p in range(rank, pairs, world) for q in (p, pieces - 1 - p))


@dataclass(frozen=True)
class PiecePlan:
    """Who prefills which tokens of a `num_tokens` prompt over `world` ranks."""

    num_tokens: int
    world: int
    rank: int

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return piece_bounds(self.num_tokens)

    def pieces_of(self, rank: int) -> list[int]:
        return rank_pieces(rank, self.world)

    @property
    def mine(self) -> list[int]:
        return self.pieces_of(self.rank)

    def tokens_of(self, rank: int) -> torch.Tensor:
        """[T_rank] int64: the token indices rank `rank` prefills, ascending (its pieces in order)."""
        bounds = self.bounds
        return torch.cat([torch.arange(*bounds[p]) for p in self.pieces_of(rank)])

    @property
    def my_tokens(self) -> torch.Tensor:
        return self.tokens_of(self.rank)


class TokenExchange:
    """The all-gathers of one token-sharded prefill (`k3.model.parallel.RowExchange`): rows of
    every rank's tokens back in token order, and per-piece tensors back in piece order."""

    def __init__(self, plan: PiecePlan, collectives: Collectives, block_row: torch.Tensor):
        self.plan, self.collectives = plan, collectives
        self.block_row = block_row                                              # [max_pages] int
        tokens = [plan.tokens_of(r) for r in range(plan.world)]
        self.width = max(len(t) for t in tokens)                                # rows each rank sends
        where = torch.empty(plan.num_tokens, dtype=torch.long)                  # token -> gathered row
        for r, t in enumerate(tokens):
            where[t] = r * self.width + torch.arange(len(t))
        device = block_row.device
        self.token_order = where.to(device)
        per = NUM_PIECES // plan.world
        at = torch.empty(NUM_PIECES, dtype=torch.long)                          # piece -> gathered row
        for r in range(plan.world):
            at[plan.pieces_of(r)] = r * per + torch.arange(per)
        self.piece_order = at.to(device)
        self.bytes_gathered = {"tokens": 0, "pieces": 0, "logits": 0}            # this rank's receive volume

    def _all_gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        wire = x.contiguous()
        if wire.dtype.is_floating_point and wire.element_size() == 1:         # float8: move the bytes
            wire = wire.view(torch.uint8)
        out = wire if self.plan.world == 1 else self.collectives.all_gather(wire, dim=0)
        self.bytes_gathered[kind] += out.numel() * out.element_size()
        return out.view(x.dtype) if out.dtype != x.dtype else out

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[T_local, ...] this rank's tokens' rows -> [T, ...] every token's, in token order."""
        pad = local.new_zeros(self.width - local.shape[0], *local.shape[1:])
        return self._all_gather(torch.cat([local, pad]), "tokens")[self.token_order]

    def gather_pieces(self, local: torch.Tensor) -> torch.Tensor:
        """[16 / W, ...] one tensor per piece of this rank (its pieces' order) -> [16, ...]."""
        return self._all_gather(local, "pieces")[self.piece_order]

    def slots(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page [T], offset [T]) of every prompt token's cache row."""
        pos = torch.arange(self.plan.num_tokens, device=self.block_row.device)
        return self.block_row[pos // page_size].long(), pos % page_size


@dataclass
class ShardedPrefillOutput:
    """logits [M, V] (every rank: the last token's, or every token's with all_logits);
    bytes_gathered: what this rank received through the all-gathers (its own rows included),
    by kind: "tokens" (latent rows, index keys: grows with the prompt; with all_logits the
    final hidden rows too), "pieces" (the KDA pieces' maps and conv tails: fixed per prompt),
    "logits" (the last token's hidden row); under TP "all_to_all" (both re-layouts of every
    MLA layer; the TP all-reduces are not counted)."""

    logits: torch.Tensor
    bytes_gathered: dict[str, int]


class TokenShardedPrefill:
    """Prefill one prompt over the ranks of `collectives`' group; every rank must call
    `prefill` with the same prompt, each with its own cache.

    TP = 1 (each rank holds the whole model): everything runs on the rank's pieces (the module
    docstring). A model sharded over a TP group of exactly these ranks (rank = the TP rank,
    world = the TP size): the TP prefill of the whole prompt, except that each MLA layer
    attends with the rank's pieces' queries over all heads (`k3.model.token_sharded_tp`).
    No expert parallelism.

    After `prefill(prompt, cache, block_row=..., state_row=..., page_size=...)` each rank's
    cache holds the unsharded prefill's rows for the prompt (latents and index keys at the
    pages of `block_row`, the KDA recurrent and conv rows at `state_row`; under TP the rank's
    heads' share, as a TP prefill leaves them)."""

    def __init__(self, model, *, rank: int, world: int, collectives: Collectives):
        par = model.parallel
        if par.ep is not None:
            raise NotImplementedError(f"token-sharded prefill runs on models without expert parallelism "
                                      f"(got EP = {par.ep.size})")
        if par.world_size != 1 and (par.world_size, par.rank) != (world, rank):
            raise NotImplementedError(f"token-sharded prefill under TP needs the TP group to be the prefill group: "
                                      f"TP rank {par.rank} of {par.world_size}, prefill rank {rank} of {world}")
        rank_pieces(rank, world)                                                # validates rank / world
        self.model, self.rank, self.world, self.collectives = model, rank, world, collectives

    @torch.no_grad()
    def prefill(self, prompt: list[int], cache: CacheViews, *, block_row: torch.Tensor, state_row: int,
                page_size: int, all_logits: bool = False) -> ShardedPrefillOutput:
        """Prefill `prompt` (a fresh sequence: no cached context) into `cache`.

        block_row [max_pages]: the sequence's pages in position order (enough for the prompt);
        state_row: its KDA state row; all_logits: every position's logits, else the last's."""
        if not prompt:
            raise ValueError("token-sharded prefill needs at least one prompt token")
        if len(block_row) * page_size < len(prompt):
            raise ValueError(f"block_row holds {len(block_row) * page_size} tokens; the prompt has {len(prompt)}")
        plan = PiecePlan(len(prompt), self.world, self.rank)
        device = block_row.device
        if self.model.parallel.world_size > 1:
            return self._prefill_tp(prompt, cache, plan, block_row, state_row, page_size, all_logits)
        ex = TokenExchange(plan, self.collectives, block_row)
        mine = [p for p in plan.mine if plan.bounds[p][1] > plan.bounds[p][0]]  # my non-empty pieces
        kda_args = (plan, ex, mine, state_row)

        def mixer(layer, h, meta, cache, per_position, states):
            if layer.is_kda:
                return _sharded_kda(layer.self_attn, h, cache, *kda_args)
            return layer.self_attn(h, meta, cache, exchange=ex)

        d = self.model.cfg.hidden_size
        if mine:
            meta = _pieces_metadata(prompt, plan, mine, block_row, state_row, page_size, device)
            hidden = self.model.model(meta, cache, mixer=mixer).hidden_states       # [T_mine, d]
        else:       # no tokens here: take part in every layer's gathers (and write the caches)
            meta = _pieces_metadata(prompt, plan, [], block_row, state_row, page_size, device)
            empty = self.model.model.embed_tokens.new_zeros(0, d)
            for layer in self.model.model.layers:
                mixer(layer, empty, meta, cache, False, {})
            hidden = empty
        if all_logits:
            rows = ex.gather(hidden)                                             # [T, d]
        else:       # the last token is piece 15's, on rank 0
            last = hidden[-1:] if self.rank == 0 else hidden.new_zeros(1, d)
            rows = last if self.world == 1 else self.collectives.all_gather(last, dim=0)[:1]
            ex.bytes_gathered["logits"] += last.numel() * last.element_size() * self.world
        return ShardedPrefillOutput(self.model.compute_logits(rows), ex.bytes_gathered)

    def _prefill_tp(self, prompt, cache, plan, block_row, state_row, page_size, all_logits) -> ShardedPrefillOutput:
        """The TP variant: a TP prefill of the whole prompt whose MLA layers attend token-sharded."""
        device = block_row.device
        mine = [p for p in plan.mine if plan.bounds[p][1] > plan.bounds[p][0]]
        meta_mine = _pieces_metadata(prompt, plan, mine, block_row, state_row, page_size, device) if mine else None
        attend = HeadsTokensAttention([plan.tokens_of(r) for r in range(self.world)], self.rank, meta_mine)
        meta = ForwardMetadata.build([prompt], context_lens=[0], state_indices=[state_row], block_table=block_row[None],
                                     page_size=page_size, all_logits=all_logits, device=device)

        def mixer(layer, h, meta, cache, per_position, states):
            if layer.is_kda:
                return layer.self_attn(h, meta, cache)[0]
            return layer.self_attn(h, meta, cache, attend=attend)

        hidden = self.model.model(meta, cache, mixer=mixer).hidden_states       # [T, d] (TP: every token)
        return ShardedPrefillOutput(self.model.compute_logits(hidden[meta.logits_indices]),
                                    {"all_to_all": attend.bytes_moved})


def _pieces_metadata(prompt, plan: PiecePlan, pieces: list[int], block_row, state_row: int, page_size: int,
                     device) -> ForwardMetadata:
    """The call of this rank's non-empty pieces: one sequence per piece, its context every
    token before it (the MLA queries read it from the gathered cache; KDA ignores it)."""
    bounds = [plan.bounds[p] for p in pieces]
    lens = [e - s for s, e in bounds]
    pos = torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in bounds] or [torch.zeros(0, dtype=torch.long)])
    ids = torch.tensor(prompt, dtype=torch.long)[pos].to(device)
    pos = pos.to(device)
    cu = torch.zeros(len(pieces) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0).to(device)
    table = block_row.to(device=device, dtype=torch.int32)
    return ForwardMetadata(
        input_ids=ids,
        positions=pos, cu_seqlens=cu,
        context_lens=torch.tensor([s for s, _ in bounds], dtype=torch.long, device=device),
        slot_mapping=table[pos // page_size].long() * page_size + pos % page_size,
        block_table=table.expand(len(pieces), -1),
        state_indices=torch.full((len(pieces),), state_row, dtype=torch.long, device=device),
        logits_indices=pos[:0], max_q_len=max(lens, default=0), num_decodes=0)


def _conv_windows(tails: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """tails [16, W-1, C]: each piece's last W-1 pre-conv rows (right-aligned, zeros before a
    short piece's); lens: the pieces' token counts. Returns [17, C, W-1]: the conv window
    before each piece and after the last (the last W-1 inputs before it, zeros before the
    prompt), in the conv state's layout."""
    width = tails.shape[1]
    window = tails.new_zeros(width, tails.shape[2])                            # [W-1, C], oldest first
    out = [window]
    for p, n in enumerate(lens):
        m = min(n, width)
        window = torch.cat([window, tails[p, width - m:]])[-width:] if m else window
        out.append(window)
    return torch.stack(out).transpose(1, 2)


def _sharded_kda(mixer: KDAMixer, x: torch.Tensor, cache: CacheViews, plan: PiecePlan, ex: TokenExchange,
                 mine: list[int], state_row: int) -> torch.Tensor:
    """One KDA layer over this rank's non-empty pieces `mine` (x [T_mine, d], their tokens in
    order), chained exactly with the other ranks' pieces (the module docstring). Writes the
    prompt's final recurrent state and conv window at `state_row`. Returns [T_mine, d]."""
    k, hl, hd = mixer.kernels, mixer.num_heads, mixer.head_dim
    view = cache.kda[mixer.kda_index]
    t = x.shape[0]
    lens = [e - s for s, e in plan.bounds]
    qkv, gate, f, b = mixer._project(x)                                        # qkv [T_mine, 3P]
    qkv, gate = qkv.contiguous(), gate.contiguous()
    conv_w = mixer.qkv_conv1d.squeeze(1)                                        # [3P, W]
    width = conv_w.shape[1] - 1
    # every piece's last W-1 pre-conv rows, right-aligned: [16 / W, W-1, 3P] -> [16, W-1, 3P]
    tails, at = qkv.new_zeros(len(plan.mine), width, qkv.shape[1]), 0
    for j, p in enumerate(plan.mine):
        m = min(lens[p], width)
        if m:
            tails[j, width - m:] = qkv[at + lens[p] - m: at + lens[p]]
        at += lens[p]
    windows = _conv_windows(ex.gather_pieces(tails), lens)                      # [17, 3P, W-1]
    state_dtype = view.recurrent.dtype
    eye = torch.eye(hd, dtype=state_dtype, device=x.device).expand(hl, hd, hd)
    A = eye.expand(len(plan.mine), hl, hd, hd).clone()                          # [16 / W, H, K, K]
    B = torch.zeros(len(plan.mine), hl, hd, hd, dtype=state_dtype, device=x.device)   # [16 / W, H, K, V]
    o = None
    if mine:
        cu = torch.zeros(len(mine) + 1, dtype=torch.int32, device=x.device)
        cu[1:] = torch.tensor([lens[p] for p in mine], dtype=torch.int32).cumsum(0).to(x.device)
        conv = k.kda.short_conv(qkv.unsqueeze(0), conv_w, conv_state=windows[mine].contiguous(), cu_seqlens=cu)
        q, kk, v = mixer.heads(conv.y)                                          # [T_mine, H, K] each
        g, beta = mixer.decay_and_beta(f, b)
        args = [z.reshape(1, t, *z.shape[1:]) for z in (q, kk, v, g, beta)]
        n = len(mine)
        from_zero = k.kda.chunked(*args, initial_state=B.new_zeros(n, hl, hd, hd), cu_seqlens=cu)
        args[2] = torch.zeros_like(args[2])                                     # v = 0: the transition only
        transition = k.kda.chunked(*args, initial_state=eye.expand(n, hl, hd, hd).contiguous(), cu_seqlens=cu)
        index = [plan.mine.index(p) for p in mine]
        A[index], B[index] = transition.state.to(state_dtype), from_zero.state.to(state_dtype)
        o, o_map = from_zero.o.reshape(t, hl, hd), transition.o.reshape(t, hl, hd)   # [T_mine, H, V], [T_mine, H, K]
    A, B = ex.gather_pieces(A), ex.gather_pieces(B)                             # [16, H, K, K], [16, H, K, V]
    starts, s = [], torch.zeros(hl, hd, hd, dtype=state_dtype, device=x.device)    # a fresh prompt
    for p in range(NUM_PIECES):
        starts.append(s)
        s = torch.einsum("hij,hjv->hiv", A[p], s) + B[p]
    view.recurrent[state_row] = s
    view.conv[state_row] = windows[-1]
    if o is None:
        return x.new_zeros(0, x.shape[1])
    cuts = torch.tensor([0] + [lens[p] for p in mine]).cumsum(0).tolist()
    o = torch.cat([(o[a:e].to(state_dtype) + torch.einsum("thk,hkv->thv", o_map[a:e].to(state_dtype), starts[p]))
                   for p, a, e in zip(mine, cuts, cuts[1:])]).to(o.dtype)                # o_t + S_in^T o'_t
    return mixer.parallel.all_reduce(F.linear(mixer.output_norm(o, gate), mixer.o_proj))
