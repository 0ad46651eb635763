"""The paged KV pool's bookkeeping: which blocks each sequence holds, which are free, and
which full blocks are cached for prefix reuse. It knows no tensors; the model writes the
keys and values of token ``i`` of a sequence at ``table[i // block_size]``, offset
``i % block_size``.

Block 0 is the null block: never handed out, so padding rows of a batch can write there.
A full block whose keys and values are computed is keyed by a digest of its tokens and of
the key of the block before it (``block_key``), so the key names the whole prefix it ends.
A request's prompt reuses every cached block its prefix matches (a reference each), never
the one holding its last token: that token is always computed, for its logits. A sequence
computed under a LoRA adapter starts its chain from that adapter's key (``root``), not
``ROOT_KEY``: its keys and values are the adapter's, and only its own requests reuse them.
Blocks nobody
references stay cached in the free queue, oldest released first, and are evicted (their
key dropped) only when handed out again: least recently used first.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0  # never handed out: padding rows and padded block tables point here
ROOT_KEY = b""  # the parent key of a sequence's first block


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A full block's cache key: a BLAKE2b digest of its parent block's key and its token
    ids (8 bytes each), so that it names the whole prefix the block ends. A cryptographic
    digest, not Python's ``hash()``: no prompt can be made to collide with another and be
    served its keys and values (vLLM's CVE-2025-25183)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=32).digest()


@dataclass(eq=False)
class BlockTable:
    """One sequence's blocks in order, and the keys of its leading full blocks that are
    registered in the cache (``keys[i]`` is block ``blocks[i]``'s)."""

    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)


class BlockManager:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens (block 0 reserved)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError("a block pool needs a block size of at least 1 and two blocks "
                             "or more (block 0 is the null block)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Blocks no sequence references, least recently released first (an ordered set).
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict(
            (block, None) for block in range(1, num_blocks))
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of those, tokens found in cached blocks

    @property
    def total(self) -> int:
        """Blocks sequences can hold (all but the null block)."""
        return self.num_blocks - 1

    @property
    def free(self) -> int:
        """Blocks that can be handed out now, cached ones nobody references included."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - self.free

    def match(self, tokens: Sequence[int], root: bytes = ROOT_KEY) -> list[int]:
        """The cached blocks holding the longest prefix of ``tokens`` made of whole blocks,
        short of the block holding the last token, computed from ``root``; no reference is
        taken (``reuse``)."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        key, size = root, self.block_size
        for index in range((len(tokens) - 1) // size):
            key = block_key(key, tokens[index * size:(index + 1) * size])
            block = self._cached.get(key)
            if block is None:
                break
            found.append(block)
        return found

    def cost(self, matched: Sequence[int], tokens: int) -> int:
        """Free blocks that taking ``matched`` and growing to ``tokens`` tokens uses up:
        new blocks, and matched ones that sit unreferenced in the free queue."""
        idle = sum(1 for block in matched if self._refs[block] == 0)
        return idle + max(0, blocks_for(tokens, self.block_size) - len(matched))

    def reuse(self, table: BlockTable, matched: Sequence[int], looked_up: int = 0) -> None:
        """Start an empty ``table`` with the ``matched`` cached blocks, a reference each;
        ``looked_up`` prompt tokens (0: none, e.g. a recomputation) count as a lookup,
        ``matched`` as its hits."""
        assert not table.blocks
        for block in matched:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            table.blocks.append(block)
            key = self._key_of[block]
            assert key is not None  # a matched block is cached
            table.keys.append(key)
        if self.prefix_caching and looked_up:
            self.prefix_queries += looked_up
            self.prefix_hits += len(matched) * self.block_size

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Give ``table`` the blocks ``tokens`` tokens need; False, taking none, if the pool
        has too few free. A block handed out loses its cache key (eviction)."""
        wanted = blocks_for(tokens, self.block_size) - len(table.blocks)
        if wanted <= 0:  # most calls: a decode step within its last block
            return True
        if wanted > len(self._free):
            return False
        for _ in range(wanted):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            table.blocks.append(block)
        return True

    def _evict(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            self._key_of[block] = None
            del self._cached[key]

    def register(self, table: BlockTable, tokens: Sequence[int], computed: int,
                 root: bytes = ROOT_KEY) -> None:
        """Key the table's full blocks among its first ``computed`` tokens (their keys and
        values now written, from ``root``) in the cache. A prefix already cached in another
        block keeps that block; this one stays private and is freed unkeyed."""
        if not self.prefix_caching:
            return
        size = self.block_size
        for index in range(len(table.keys), computed // size):
            parent = table.keys[-1] if table.keys else root
            key = block_key(parent, tokens[index * size:(index + 1) * size])
            block = table.blocks[index]
            if key not in self._cached and self._key_of[block] is None:
                self._cached[key] = block
                self._key_of[block] = key
            table.keys.append(key)

    def release(self, table: BlockTable) -> None:
        """Drop the table's references; blocks nobody references join the free queue, its
        last blocks first so that they are evicted before the prefix they extend."""
        for block in reversed(table.blocks):
            self._refs[block] -= 1
            assert self._refs[block] >= 0
            if self._refs[block] == 0:
                self._free[block] = None
        table.blocks.clear()
        table.keys.clear()
