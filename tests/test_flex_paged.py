"""Paged decode attention through FlexAttention (``flex``) gives ``decode_attention``'s
output over shuffled pool blocks (grouped-query heads, sliding windows, padding rows,
shared prefix blocks, values of their own width), its block mask built in a compiled
graph lists exactly the blocks each row holds, and the positions it reads follow the
rows' lengths, not the context's width.

On the CPU torch's eager flex scores every pool slot through ``mask_mod`` alone (it
ignores the block lists), so the lists are checked through inductor's compiled CPU flex,
which visits only the listed blocks: a block missing from a row's list, or another
row's block in it, changes that row's output there."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpuflow.serve.generate.attention import decode_attention
from gpuflow.serve.generate.blocks import blocks_for
from gpuflow.serve.generate.flex import (
    flex_applies,
    flex_decode_attention,
    flex_supported,
    kernel_options,
    paged_decode_mask,
    read_positions,
)
from gpuflow.serve.generate.paged import KVPool

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning")]  # eager flex's "unfused"

# Measured max |flex - decode_attention|: 3.8e-7 over these cases, 5 seeds each (fp32,
# unit-normal keys): the same softmax over the same positions, summed in another order.
TOLERANCE = 2e-6


def pool_and_tables(lengths: list[int], block_size: int, kv_heads: int = 2, head_dim: int = 8,
                    value_dim: int | None = None, shared: int = 0, seed: int = 0
                    ) -> tuple[KVPool, torch.Tensor, torch.Tensor]:
    """A 2-layer pool of random keys and values, each row's blocks drawn shuffled from it
    (never the null block), tables padded with it to one more block than the longest row
    needs; the first ``shared`` blocks of every row are the same blocks (a cached prefix)."""
    rng = random.Random(seed)
    need = [blocks_for(n, block_size) for n in lengths]
    num_blocks = 1 + shared + sum(n - shared for n in need) + 3  # 3 blocks nobody holds
    pool = KVPool(2, num_blocks, kv_heads, block_size, head_dim, "cpu", torch.float32,
                  value_dim)
    generator = torch.Generator().manual_seed(seed)
    pool.keys.normal_(generator=generator)
    pool.values.normal_(generator=generator)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared)]
    width = max(need) + 1
    tables = [prefix + [free.pop() for _ in range(n - shared)] for n in need]
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return pool, padded, torch.tensor(lengths) - 1


CASES = {  # lengths, block size, query heads over 2 KV heads, window, value dim, shared
    "mixed, grouped heads": ([1, 16, 17, 40, 100, 7], 16, 4, None, None, 0),
    "sliding window": ([1, 16, 17, 40, 100, 7], 16, 4, 20, None, 0),
    "32-token blocks": ([3, 32, 33, 150], 32, 2, None, None, 0),
    "window of 48-token blocks": ([5, 49, 97, 300], 48, 8, 50, None, 0),
    "shared prefix, own value width": ([40, 52, 64], 16, 4, None, 12, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_flex_equals_decode_attention(case: str) -> None:
    lengths, block_size, heads, window, value_dim, shared = CASES[case]
    pool, tables, positions = pool_and_tables(lengths, block_size, value_dim=value_dim,
                                              shared=shared)
    q = torch.randn(len(lengths), heads, 8, generator=torch.Generator().manual_seed(1))
    want = decode_attention(q, pool, 1, positions, tables, 0.3, window)
    got = flex_decode_attention(q, pool, 1, positions, tables, 0.3, window)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def test_padding_rows_read_the_null_block_as_decode_attention_does() -> None:
    """A padding row (token 0 at position 0, a table of null blocks) attends to slot 0."""
    pool, tables, positions = pool_and_tables([30, 5], 16)
    tables[1], positions[1] = 0, 0
    q = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(flex_decode_attention(q, pool, 0, positions, tables),
                               decode_attention(q, pool, 0, positions, tables),
                               rtol=0, atol=TOLERANCE)


@pytest.mark.slow
def test_mask_built_in_a_compiled_graph_lists_exactly_each_rows_blocks() -> None:
    """The mask built inside ``torch.compile`` (where its ``mask_mod`` tests only a row's
    last and window's first block) through the compiled CPU kernel, which visits only the
    listed blocks: rows shorter than the window, rows past it, a padding row. ~17 s (a
    C++ compile), ~5 s from inductor's cache."""
    lengths, block_size, window = [1, 16, 17, 40, 100, 1], 16, 20
    pool, tables, positions = pool_and_tables(lengths, block_size, head_dim=16)
    tables[-1] = 0
    num_blocks = pool.num_blocks
    q = torch.randn(len(lengths), 4, 16, generator=torch.Generator().manual_seed(3))

    def step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        mask = paged_decode_mask(tables, positions, block_size, num_blocks, window)
        # Inductor's CPU template wants a list as wide as the pool (CUDA's take any).
        wide = BlockMask.from_kv_blocks(
            mask.kv_num_blocks, F.pad(mask.kv_indices, (0, num_blocks - tables.shape[1])),
            BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod,
            seq_lengths=mask.seq_lengths, compute_q_blocks=False)
        return flex_attention(q, keys, values, block_mask=wide, enable_gqa=True,
                              kernel_options=kernel_options(mask))

    def whole(tensor: torch.Tensor) -> torch.Tensor:
        return tensor[1].flatten(0, 1).transpose(0, 1)[None]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = torch.compile(step, fullgraph=True, dynamic=False)(
            q[:, :, None].contiguous(), whole(pool.keys), whole(pool.values), positions,
            tables)[:, :, 0]
    want = decode_attention(q, pool, 1, positions, tables, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def test_positions_read_follow_the_rows_lengths() -> None:
    """64 rows of 16 to 4,000 tokens in 16-token blocks: flex's mask reads at most 1.1
    times the positions held (the partial last block of each row), where the padded path
    reads every row's table width, the context's."""
    rng = random.Random(4)
    lengths = [rng.randint(16, 4000) for _ in range(64)]
    block_size, context = 16, 32768
    width = context // block_size
    blocks = iter(range(1, 1 + sum(blocks_for(n, block_size) for n in lengths)))
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        tables[row, :blocks_for(n, block_size)] = torch.tensor(
            [next(blocks) for _ in range(blocks_for(n, block_size))])
    num_blocks = int(tables.max()) + 1
    mask = paged_decode_mask(tables, torch.tensor(lengths) - 1, block_size, num_blocks)
    held = sum(lengths)
    assert read_positions(mask) == sum(blocks_for(n, block_size) * block_size
                                       for n in lengths)
    assert read_positions(mask) / held <= 1.1
    assert len(lengths) * width * block_size / held > 15  # the padded path, at 32k


def test_a_window_bounds_the_positions_read() -> None:
    tables = torch.arange(1, 1 + 4 * 64).view(4, 64)
    mask = paged_decode_mask(tables, torch.tensor([1000, 1023, 100, 10]), 16, 257, 128)
    assert mask.kv_num_blocks.flatten().tolist() == [9, 8, 7, 1]
    assert read_positions(mask) == 25 * 16


def test_block_sizes_flex_takes() -> None:
    assert [flex_supported(size) for size in (1, 5, 8, 16, 32, 48)] == \
        [False, False, False, True, True, True]
    tables, positions = torch.ones(1, 4, dtype=torch.long), torch.tensor([3])
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_decode_mask(tables, positions, 8, 8)
    tile = {size: kernel_options(paged_decode_mask(tables, positions, size, 8))["BLOCK_N"]
            for size in (16, 32, 48, 128)}
    assert tile == {16: 16, 32: 32, 48: 16, 128: 64}


def test_flex_applies_on_cuda_alone() -> None:
    """The CPU keeps ``decode_attention``; so do blocks and widths flex's kernels refuse."""
    pool = KVPool(1, 4, 2, 16, 16, "cpu", torch.float32)
    assert not flex_applies(torch.zeros(1, 4, 16), pool)
