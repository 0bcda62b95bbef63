"""Row allocator of the packed cache: one free list for attention and state rows alike,
reference counts for rows shared by several requests (prefix caching)."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Rows first_row..first_row+num_rows-1. Allocation is all-or-nothing; freeing returns a
    row once its reference count drops to zero."""

    def __init__(self, num_rows: int, *, first_row: int = 0):
        if num_rows < 1:
            raise ValueError(f"the cache has no rows ({num_rows}): give it more memory or a smaller block size")
        self.num_rows, self.first_row = num_rows, first_row
        self._free = deque(range(first_row, first_row + num_rows))
        self._refs = {r: 0 for r in range(first_row, first_row + num_rows)}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_rows - len(self._free)

    def refcount(self, row: int) -> int:
        """How many holders row `row` has (0: free)."""
        return self._refs[row]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh rows (reference count 1), or None when fewer than n are free."""
        if n > len(self._free):
            return None
        rows = [self._free.popleft() for _ in range(n)]
        for r in rows:
            self._refs[r] = 1
        return rows

    def incref(self, rows: list[int]) -> None:
        for r in rows:
            if self._refs[r] <= 0:
                raise ValueError(f"row {r} is not allocated")
            self._refs[r] += 1

    def free(self, rows: list[int]) -> None:
        for r in rows:
            if self._refs[r] <= 0:
                raise ValueError(f"row {r} freed twice")
            self._refs[r] -= 1
            if self._refs[r] == 0:
                self._free.append(r)
