"""Memory snapshots for state reuse across turns (llama-server's prompt cache, for a recurrent state).

Clover's memory after a history depends on the tokens and on where the block boundaries fell.
A fresh run commits a prompt in blocks of B from position 0 (the last block may be short), so a
snapshot can stand in for the start of a later fresh run only if it holds a history committed
in full blocks of B from position 0: its length is a multiple of B and it is a token prefix of
the later prompt, decoded with the same B. Only such snapshots are stored; the rule is in
docs/CONTRACTS.md ("State reuse").
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class StateCache:
    """LRU of at most `capacity` snapshots, keyed by (block size, committed tokens)."""

    def __init__(self, capacity: int):
        self.capacity = max(0, int(capacity))
        self._entries: OrderedDict[tuple[int, tuple[int, ...]], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.stores = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def lookup(self, tokens: list[int], block_size: int) -> tuple[int, bytes | None]:
        """(n, snapshot) of the longest stored prefix of `tokens` for this block size; (0, None) if none."""
        best, key = 0, None
        with self._lock:
            for k in self._entries:
                bs, pre = k
                n = len(pre)
                if bs == block_size and best < n <= len(tokens) and tuple(tokens[:n]) == pre:
                    best, key = n, k
            if key is None:
                self.misses += 1
                return 0, None
            self._entries.move_to_end(key)
            self.hits += 1
            return best, self._entries[key]

    def store(self, tokens: list[int], block_size: int, snapshot: bytes) -> bool:
        """Keep a snapshot of `tokens` committed in full blocks of block_size from position 0."""
        n = len(tokens)
        if self.capacity == 0 or n == 0 or n % block_size:
            return False
        key = (int(block_size), tuple(int(t) for t in tokens))
        with self._lock:
            self._entries[key] = snapshot
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
            self.stores += 1
        return True

    def has(self, tokens: list[int], block_size: int) -> bool:
        with self._lock:
            return (int(block_size), tuple(int(t) for t in tokens)) in self._entries

    def stats(self) -> dict:
        return {
            "snapshots": len(self._entries),
            "capacity": self.capacity,
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "stores": self.stores,
        }
