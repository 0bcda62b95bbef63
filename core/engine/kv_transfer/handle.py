"""The transfer handle: what a producer returns in `kv_transfer_params` and a consumer pulls
with (vLLM's field name and its do_remote_decode / do_remote_prefill flags), and the digests
both sides compare so a mismatch falls back to local prefill instead of decoding from rows
of another prompt or another row format."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from k3.cache.format import CacheFormat
from k3.cache.plan import RowLayout
from k3.cache.pool import CachePool

HANDLE_KEYS = ("transfer_id", "remote_engine_id", "remote_control", "remote_data", "remote_base", "row_bytes",
               "block_size", "layout_digest", "num_tokens", "prompt_digest", "rows", "state_row", "first_token",
               "first_logprob")


def prompt_digest(token_ids: list[int]) -> str:
    """A digest of a prompt's token ids (the consumer checks it against its own prompt)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))
    return h.hexdigest()


def layout_digest(cache: CachePool) -> str:
    """A digest of a pool's row format (regions, block size, dtypes, TP size, KDA layout):
    equal digests mean a row can be copied byte for byte between the two pools."""
    return format_digest(cache.layout, cache.format)


def format_digest(layout: RowLayout, fmt: CacheFormat) -> str:
    return hashlib.blake2b(repr((layout, fmt)).encode(), digest_size=16).hexdigest()


def layout_at_tp(cache: CachePool, tensor_parallel_size: int) -> tuple[RowLayout, str]:
    """(row layout, digest) of `cache`'s format at another tensor-parallel size: what a producer
    of that size uses when every other choice (model, dtypes, block size, alignment, KDA state
    layout) is this pool's. Equal digests mean only the KDA heads' split differs."""
    fmt = dataclasses.replace(cache.format, tensor_parallel_size=tensor_parallel_size)
    layout = fmt.layout(cache.cfg)
    return layout, format_digest(layout, fmt)


@dataclass(frozen=True)
class TransferHandle:
    """A producer's published request: its attention rows (position order) and KDA state row
    at `remote_base + row * row_bytes` of the producer's registered cache, readable through
    `remote_data` until confirmed on `remote_control`; the first token it sampled."""

    transfer_id: str
    remote_engine_id: str
    remote_control: str
    remote_data: str
    remote_base: int
    row_bytes: int
    block_size: int
    layout_digest: str
    num_tokens: int                 # prompt tokens the rows hold
    prompt_digest: str
    rows: tuple[int, ...]
    state_row: int | None
    first_token: int
    first_logprob: float
    first_top: tuple | None = None  # ([ids], [logprobs]) when the request asked for top logprobs
    # tensor parallelism: the producer's TP ranks, each (data endpoint, registered base) in TP
    # order; rows are the same indices on every rank (its leader allocates them for all).
    # Empty: one rank, (remote_data, remote_base)
    ranks: tuple[tuple[str, int], ...] = ()

    @property
    def tp_size(self) -> int:
        return len(self.ranks) or 1

    def rank(self, r: int) -> tuple[str, int]:
        """(data endpoint, base address) of the producer's TP rank r."""
        return self.ranks[r] if self.ranks else (self.remote_data, self.remote_base)

    def to_params(self) -> dict:
        """The JSON `kv_transfer_params` of the producer's answer (do_remote_prefill set)."""
        out = {k: getattr(self, k) for k in HANDLE_KEYS}
        out["rows"] = list(self.rows)
        out["first_top"] = None if self.first_top is None else [list(self.first_top[0]), list(self.first_top[1])]
        out["ranks"] = [list(r) for r in self.ranks]
        return {"do_remote_prefill": True, **out}

    @classmethod
    def from_params(cls, params: dict) -> "TransferHandle":
        """The handle in a consumer's kv_transfer_params; ValueError naming a missing or bad key."""
        missing = [k for k in HANDLE_KEYS if k not in params]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {', '.join(missing)}")
        try:
            top = params.get("first_top")
            return cls(transfer_id=str(params["transfer_id"]), remote_engine_id=str(params["remote_engine_id"]),
                       remote_control=str(params["remote_control"]), remote_data=str(params["remote_data"]),
                       remote_base=int(params["remote_base"]), row_bytes=int(params["row_bytes"]),
                       block_size=int(params["block_size"]), layout_digest=str(params["layout_digest"]),
                       num_tokens=int(params["num_tokens"]), prompt_digest=str(params["prompt_digest"]),
                       rows=tuple(int(r) for r in params["rows"]),
                       state_row=None if params["state_row"] is None else int(params["state_row"]),
                       first_token=int(params["first_token"]), first_logprob=float(params["first_logprob"]),
                       first_top=None if top is None else (tuple(int(t) for t in top[0]),
                                                           tuple(float(v) for v in top[1])),
                       ranks=tuple((str(data), int(base)) for data, base in params.get("ranks") or ()))
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"kv_transfer_params is malformed: {e}") from None
