"""Prefix caching for the hybrid cache: hashed units, KDA checkpoints, clamped hits.

Prompts are hashed as a chain of prefix-match units (`unit` tokens, dividing the row's block
size): unit k's key covers every token before its end, so equal keys mean equal prefixes.
A prompt with images passes their placeholder spans (`media`: (offset, tokens, content hash) per
image): a unit that covers any placeholder of an image mixes that image's hash and offset into
its key, so two prompts share a unit only when their images up to its end are the same pictures
at the same places (the placeholder token ids alone are equal for every image).
Each cached unit names the row holding its latent and index-key pages (and every earlier
token of its block); the cache holds one pool reference per row it uses, so rows outlive the
request that wrote them.

The KDA recurrence is only resumable where its state was saved, so a hit is clamped to the
deepest KDA checkpoint (a state row saved after exactly that many tokens, emitted inside the
prefill pass) not beyond the attention hit; without a checkpoint a hybrid model reuses
nothing rather than resume the recurrence from a wrong state. Eviction is LRU over leaves:
a unit goes only after its descendants, and takes the checkpoint saved at it, so no entry
survives that points past a missing page.

Every call takes a `salt` that starts the key chain (b"": none): requests that must never share
cached prefixes (two LoRA adapters, or the base model and an adapter) hash with different salts,
so equal token prefixes under different salts are different keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from .block_pool import BlockPool


@dataclass
class _Unit:
    key: bytes
    parent: bytes | None
    end: int                      # tokens covered by the chain through this unit
    row: int
    children: set = field(default_factory=set)
    last_used: int = 0


@dataclass(frozen=True)
class PrefixHit:
    """tokens reused; rows holding [0, tokens) in order (the last one partly, when tokens is
    not a multiple of the block); the checkpoint's state row (None: no KDA state needed)."""

    tokens: int
    rows: list[int]
    checkpoint_row: int | None


@dataclass
class PrefixStats:
    """Lookups since start-up: queries and hits count lookups; queried_tokens the tokens looked
    up, reused_tokens those found (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens)."""

    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    reused_tokens: int = 0


class PrefixCache:
    def __init__(self, pool: BlockPool, *, block_size: int, unit: int, needs_checkpoints: bool = True):
        if unit < 1 or block_size % unit:
            raise ValueError(f"the prefix-match unit ({unit}) must divide the block size ({block_size})")
        self.pool, self.block, self.unit = pool, block_size, unit
        self.needs_checkpoints = needs_checkpoints
        self.units: dict[bytes, _Unit] = {}
        self.checkpoints: dict[bytes, int] = {}         # unit key -> state row (state after that unit)
        self._row_users: dict[int, int] = {}             # row -> cached units in it
        self._clock = 0
        self.stats = PrefixStats()

    # ------------------------------------------------------------------ keys
    def keys(self, tokens: list[int], num_units: int, media: Sequence[tuple[int, int, bytes]] = (),
             salt: bytes = b"") -> list[bytes]:
        """Chain keys of the first num_units units of tokens, the chain started from `salt`
        (media: see the module docstring)."""
        out, parent = [], salt
        for k in range(num_units):
            lo, hi = k * self.unit, (k + 1) * self.unit
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens[lo: hi]))
            for offset, length, key in media:
                if offset < hi and lo < offset + length:
                    h.update(b"image" + offset.to_bytes(8, "little") + key)
            parent = h.digest()
            out.append(parent)
        return out

    def _touch(self, unit: _Unit) -> None:
        self._clock += 1
        unit.last_used = self._clock

    # ------------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int], media: Sequence[tuple[int, int, bytes]] = (),
               salt: bytes = b"") -> PrefixHit:
        """The longest reusable prefix of `tokens`, leaving at least one token to compute."""
        self.stats.queries += 1
        self.stats.queried_tokens += len(tokens)
        keys = self.keys(tokens, (len(tokens) - 1) // self.unit, media, salt)
        matched = 0
        while matched < len(keys) and keys[matched] in self.units:
            matched += 1
        usable, ckpt = matched, None
        if self.needs_checkpoints:
            usable = next((j for j in range(matched, 0, -1) if keys[j - 1] in self.checkpoints), 0)
            ckpt = self.checkpoints[keys[usable - 1]] if usable else None
        if usable == 0:
            return PrefixHit(0, [], None)
        for k in range(usable):
            self._touch(self.units[keys[k]])
        # Units of one block may live in different rows: a request that extended a partly used
        # block did so in its own copy. The row holding a block's deepest used unit holds
        # every earlier token of that block too (written there, or copied in before).
        per_row = self.block // self.unit
        rows = [self.units[keys[min(k + per_row, usable) - 1]].row for k in range(0, usable, per_row)]
        self.stats.hits += 1
        self.stats.reused_tokens += usable * self.unit
        return PrefixHit(usable * self.unit, rows, ckpt)

    def lookup_rows(self, tokens: list[int], media: Sequence[tuple[int, int, bytes]] = (),
                    salt: bytes = b"") -> list[int]:
        """The rows of the leading full blocks of `tokens` the cache holds, attention only (no
        KDA checkpoint clamp: for a request whose state comes from elsewhere, a disaggregated
        prefill). The caller takes its own references."""
        self.stats.queries += 1
        self.stats.queried_tokens += len(tokens)
        keys = self.keys(tokens, len(tokens) // self.unit, media, salt)
        matched = 0
        while matched < len(keys) and keys[matched] in self.units:
            matched += 1
        per_row = self.block // self.unit
        full = matched // per_row
        if full == 0:
            return []
        for k in range(full * per_row):
            self._touch(self.units[keys[k]])
        self.stats.hits += 1
        self.stats.reused_tokens += full * self.block
        return [self.units[keys[(b + 1) * per_row - 1]].row for b in range(full)]

    # ------------------------------------------------------------------ insertion
    def register(self, tokens: list[int], rows: list[int], computed: int, start_unit: int = 0,
                 media: Sequence[tuple[int, int, bytes]] = (), salt: bytes = b"") -> int:
        """Cache the full units among the first `computed` tokens, held in `rows` (the request's
        rows in position order). Returns the number of units now registered for it."""
        n = computed // self.unit
        if n <= start_unit:
            return start_unit
        keys = self.keys(tokens, n, media, salt)
        for k in range(start_unit, n):
            if keys[k] in self.units:
                continue
            row = rows[k * self.unit // self.block]
            parent = keys[k - 1] if k else None
            unit = _Unit(keys[k], parent, (k + 1) * self.unit, row)
            self._touch(unit)
            self.units[keys[k]] = unit
            if parent is not None and parent in self.units:
                self.units[parent].children.add(keys[k])
            if self._row_users.get(row, 0) == 0:
                self.pool.incref([row])
            self._row_users[row] = self._row_users.get(row, 0) + 1
        return n

    def add_checkpoint(self, tokens: list[int], position: int, state_row: int,
                       media: Sequence[tuple[int, int, bytes]] = (), salt: bytes = b"") -> bool:
        """Keep `state_row` (the KDA state after `position` tokens, a unit boundary) as a
        checkpoint. The cache takes over the row's reference; a duplicate is freed. Returns
        whether it was kept."""
        if position <= 0 or position % self.unit:
            raise ValueError(f"checkpoint position {position} is not a positive multiple of the unit {self.unit}")
        key = self.keys(tokens, position // self.unit, media, salt)[-1]
        if key in self.checkpoints or key not in self.units:
            self.pool.free([state_row])
            return False
        self.checkpoints[key] = state_row
        return True

    def has_checkpoint(self, tokens: list[int], position: int, media: Sequence[tuple[int, int, bytes]] = (),
                       salt: bytes = b"") -> bool:
        return self.keys(tokens, position // self.unit, media, salt)[-1] in self.checkpoints

    # ------------------------------------------------------------------ eviction
    def evict(self, rows_wanted: int) -> int:
        """Drop least recently used leaves until `rows_wanted` rows went back to the pool (or
        nothing evictable is left). Returns the rows freed."""
        freed = 0
        while freed < rows_wanted:
            leaves = [u for u in self.units.values() if not u.children]
            if not leaves:
                break
            before = self.pool.num_free
            self._drop(min(leaves, key=lambda u: u.last_used))
            freed += self.pool.num_free - before
        return freed

    def _drop(self, unit: _Unit) -> None:
        del self.units[unit.key]
        if unit.parent is not None and unit.parent in self.units:
            self.units[unit.parent].children.discard(unit.key)
        state_row = self.checkpoints.pop(unit.key, None)
        if state_row is not None:
            self.pool.free([state_row])
        self._row_users[unit.row] -= 1
        if self._row_users[unit.row] == 0:
            del self._row_users[unit.row]
            self.pool.free([unit.row])

    @property
    def num_checkpoint_rows(self) -> int:
        return len(self.checkpoints)

    @property
    def num_cached_rows(self) -> int:
        return len(self._row_users)

    @property
    def num_evictable_rows(self) -> int:
        """Rows only this cache holds (no running request shares them): what evicting every
        unit and checkpoint would give back to the pool. vLLM counts such idle cached blocks as
        free in its KV-cache usage."""
        rows = [*self._row_users, *self.checkpoints.values()]
        return sum(self.pool.refcount(r) == 1 for r in rows)
