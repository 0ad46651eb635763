"""The paged KV seam: prompts prefilled in chunks and decoded among each other over shuffled
blocks of one pool give the logits of each model's own forward over the whole sequence
(gpuflow's GPT, the Llama family's own forward, transformers' forward; full and sliding-window
layers), and the static-shape decode step equals the step's forward, its padding rows
writing only the null block."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hub_models import HubModels
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen2Config

from gpuflow.models.gpt import GPT, GPTConfig
from gpuflow.serve.generate import attention, paged
from gpuflow.serve.generate.hf_models import HFCausalLM
from gpuflow.serve.generate.llama import LlamaDecoder
from gpuflow.serve.generate.models import GPTDecoder
from gpuflow.serve.generate.paged import KVPool, PagedLM, RowSpec, StepBatch, Wanted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 5 divides no model's context (64, 128, 256); sequence B's prompt fills 4 blocks exactly,
# and A's fifth decode step ends its fifth block.
BLOCK = 5
LENGTHS = {"A": 26, "B": 24, "C": 14}
# Each step's rows (sequence, new tokens, logits wanted); the forward puts decode rows first.
SCHEDULE: list[list[tuple[str, int, Wanted]]] = [
    [("A", 7, "all"), ("B", 5, "last")],
    [("A", 8, "none"), ("B", 15, "all")],
    [("A", 8, "last"), ("B", 1, "last"), ("C", 6, "all")],
    [("C", 6, "last"), ("A", 1, "last"), ("B", 1, "last")],
    [("A", 1, "last"), ("B", 1, "last"), ("C", 1, "last")],
]  # then one decode step of all three, through forward and decode_step
Reference = Callable[[list[int]], torch.Tensor]  # a whole sequence's logits, no cache


def gpt() -> tuple[PagedLM, Reference]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=64, layers=2, dim=32, heads=4)).eval()
    return GPTDecoder(model, torch.float32), lambda tokens: model(torch.tensor([tokens]))[0]


def hf(model: torch.nn.Module, lm: HFCausalLM) -> tuple[PagedLM, Reference]:
    def reference(tokens: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([tokens])).logits[0, :, :lm.vocab_size]

    return lm, reference


def gpt2() -> tuple[PagedLM, Reference]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                       n_positions=128)).eval()
    model.set_attn_implementation("sdpa")
    return hf(model, HFCausalLM(model, torch.float32))


def qwen2_sliding(kind: type[HFCausalLM]) -> tuple[PagedLM, Reference]:
    """Layer 0 sees the whole prefix, layer 1 the last 6 positions (shorter than every
    sequence here), with grouped key/value heads."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, use_sliding_window=True,
                         sliding_window=6, max_window_layers=1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    lm = kind(model, torch.float32)
    assert lm.shape.windows == (None, 6)
    return hf(model, lm)


def hub_llama(directory: Path) -> tuple[PagedLM, Reference]:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval()
    return hf(model, LlamaDecoder(model, torch.float32, tokenized=True))


MODELS = ["gpt", "llama", "gpt2", "qwen2-sliding", "qwen2-sliding-transformers"]


@pytest.fixture(scope="module", params=MODELS)
def paged_lm(request: pytest.FixtureRequest,
             hub_models: HubModels) -> tuple[PagedLM, Reference]:
    name = request.param
    if name == "llama":
        return hub_llama(hub_models["llama"])
    if name.startswith("qwen2"):
        return qwen2_sliding(HFCausalLM if name.endswith("transformers") else LlamaDecoder)
    return {"gpt": gpt, "gpt2": gpt2}[name]()


class Sequences:
    """Sequences A, B and C of random tokens, each with a shuffled, non-contiguous block
    table of one pool, and how many tokens of each the pool holds so far."""

    def __init__(self, lm: PagedLM) -> None:
        rng = random.Random(0)
        self.tokens = {name: [rng.randrange(lm.vocab_size) for _ in range(length)]
                       for name, length in LENGTHS.items()}
        blocks = list(range(1, 20))
        rng.shuffle(blocks)
        self.blocks: dict[str, list[int]] = {}
        for name, length in LENGTHS.items():
            count = -(-length // BLOCK)
            self.blocks[name], blocks = blocks[:count], blocks[count:]
        self.done = dict.fromkeys(LENGTHS, 0)
        self.pool = lm.new_pool(20, BLOCK)

    def step(self, rows: list[tuple[str, int, Wanted]], max_blocks: int | None = None
             ) -> tuple[StepBatch, list[tuple[str, int]]]:
        """The batch of ``rows``, decode rows first, and the (sequence, position) of each
        logit it asks for."""
        specs, wanted = [], []
        for name, count, want in sorted(rows, key=lambda row: row[1] != 1):
            start = self.done[name]
            specs.append(RowSpec(self.tokens[name][start:start + count], start,
                                 self.blocks[name], want))
            ends = {"all": range(start, start + count), "last": [start + count - 1],
                    "none": []}
            wanted += [(name, position) for position in ends[want]]
            self.done[name] += count
        return StepBatch.build(specs, BLOCK, max_blocks=max_blocks), wanted


@torch.inference_mode()
def test_chunked_prefill_and_mixed_decode_equal_the_whole_sequence_forward(
        paged_lm: tuple[PagedLM, Reference]) -> None:
    lm, reference = paged_lm
    sequences = Sequences(lm)
    expected = {name: reference(tokens) for name, tokens in sequences.tokens.items()}
    checked = 0
    for rows in SCHEDULE:
        batch, wanted = sequences.step(rows)
        logits = lm.forward(batch, sequences.pool)
        assert logits.shape == (len(wanted), lm.vocab_size)
        for (name, position), row in zip(wanted, logits, strict=True):
            torch.testing.assert_close(row, expected[name][position], atol=1e-4, rtol=1e-4)
        checked += len(wanted)
    assert checked == 7 + 1 + 15 + 1 + 1 + 6 + 1 + 1 + 1 + 3
    assert sequences.done == {"A": 25, "B": 23, "C": 13}

    # The last token of each through decode_step, in a batch of 4 padded to the widest
    # table a sequence of the whole context has: the padding row writes the null block only.
    width = -(-lm.context // BLOCK)
    batch, wanted = sequences.step([(name, 1, "last") for name in LENGTHS], width)
    stepped = lm.forward(batch, sequences.pool)
    for (name, position), row in zip(wanted, stepped, strict=True):
        torch.testing.assert_close(row, expected[name][position], atol=1e-4, rtol=1e-4)
    pool = sequences.pool
    before = pool.keys.clone(), pool.values.clone()
    assert not before[0][:, 0].any()  # nothing wrote the null block so far
    padded = [torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # token 0 at 0, null blocks
              for t in (batch.tokens, batch.positions, batch.slot_mapping, batch.block_tables)]
    logits = lm.decode_step(*padded, pool)
    assert logits.shape == (4, lm.vocab_size)
    torch.testing.assert_close(logits[:3], stepped, atol=1e-5, rtol=1e-5)
    for tensor, old in zip((pool.keys, pool.values), before, strict=True):
        # The real rows write again what forward wrote, within rounding.
        torch.testing.assert_close(tensor[:, 1:], old[:, 1:], atol=1e-5, rtol=1e-5)
        assert tensor[:, 0].any()
    assert lm.written(pool) == [pool.keys, pool.values]


@torch.inference_mode()
def test_decode_rows_sharing_prefix_blocks_equal_the_whole_sequence_forward(
        paged_lm: tuple[PagedLM, Reference], monkeypatch: pytest.MonkeyPatch) -> None:
    """Three sequences continue one prompt prefix whose blocks they share, as the prefix
    cache gives them: their prompts' chunks, then their decode tokens, each step together,
    attend to those blocks once (for any shared length here), beside a new prompt's chunk
    that shares nothing, and still give each whole sequence's logits (sliding-window
    layers, which attend row by row, included)."""
    monkeypatch.setattr(paged, "SHARED_MIN_SAVED", 1)
    lm, reference = paged_lm
    rng = random.Random(1)
    prefix = [rng.randrange(lm.vocab_size) for _ in range(3 * BLOCK)]
    tokens = {name: prefix + [rng.randrange(lm.vocab_size) for _ in range(own + 3)]
              for name, own in (("A", 4), ("B", 9), ("C", 2))}
    shared, pool = [7, 2, 11], lm.new_pool(20, BLOCK)
    tables = {"A": shared + [5, 13], "B": shared + [1, 9, 4], "C": shared + [16]}
    lm.forward(StepBatch.build([RowSpec(prefix, 0, shared, "none")], BLOCK), pool)
    done = {name: len(t) - 3 for name, t in tokens.items()}  # prompts: prefix + own
    chunks = StepBatch.build([RowSpec(tokens[n][len(prefix):done[n]], len(prefix), tables[n],
                                      "all") for n in tokens], BLOCK)
    assert chunks.shared == (3, 3)
    logits = iter(lm.forward(chunks, pool))
    for name in tokens:
        expected = reference(tokens[name][:done[name]])
        for position in range(len(prefix), done[name]):
            torch.testing.assert_close(next(logits), expected[position], atol=1e-4, rtol=1e-4)
    other = [rng.randrange(lm.vocab_size) for _ in range(2 * BLOCK)]
    for step in range(3):
        rows = [RowSpec([tokens[n][done[n]]], done[n], tables[n]) for n in tokens]
        if step == 0:  # the decode rows share 3 blocks, the new prompt none: only they do
            rows.append(RowSpec(other, 0, [3, 6]))
        batch = StepBatch.build(rows, BLOCK)
        assert batch.shared == (3, 3)
        logits = lm.forward(batch, pool)
        for name, row in zip(tokens, logits[:3], strict=True):
            expected = reference(tokens[name][:done[name] + 1])[-1]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
            done[name] += 1
        if step == 0:
            torch.testing.assert_close(logits[3], reference(other)[-1], atol=1e-4, rtol=1e-4)


def test_rows_share_leading_blocks_only_where_it_spares_gathers() -> None:
    """The shared blocks: leading ones common to every row, each row's new tokens (from
    its start on) kept out of them, counted only when the other rows are spared
    ``SHARED_MIN_SAVED`` positions; never for one row."""
    size = 16
    tables = [[4, 5, 6, 7, 8], [4, 5, 6, 9], [4, 5, 6, 7, 10]]
    starts = [size * 5 - 1, size * 3, size * 5 - 1]
    assert paged.shared_prefix(tables, starts, size) == 0  # 2 rows spared 3 blocks: 96 < 768
    spared = [[*range(1, 20), 20 + row] for row in range(4)]  # 19 shared blocks, 3 rows spared
    assert paged.shared_prefix(spared, [size * 19 + 4] * 4, size) == 19
    assert paged.shared_prefix(spared, [size * 19 - 1] * 4, size) == 18  # a token in block 19
    assert paged.shared_prefix(spared[:1], [size * 19 + 4], size) == 0
    decoding = [RowSpec([1], size * 19 + 4, table) for table in spared]
    chunk = RowSpec([1] * 8, size * 2, spared[0][:2] + [30, 31])  # shares only 2 blocks
    assert paged.cascade(decoding + [chunk], 4, size) == (4, 19)  # the decode rows alone
    assert paged.cascade(decoding, 4, size) == (4, 19)
    assert paged.cascade([chunk, chunk], 0, size) == (0, 0)  # 2 blocks: 32 < 768


def test_the_pool_is_allocated_once_and_sized_by_the_model() -> None:
    lm, _ = gpt()
    pool = lm.new_pool(7, 16)
    # 2 layers x 4 heads x 16 positions x (8 + 8) dims x 4 bytes, per block.
    assert lm.bytes_per_block(16) == 2 * 4 * 16 * 16 * 4
    assert pool.nbytes() == 7 * lm.bytes_per_block(16)
    assert pool.keys.shape == (2, 7, 16, 4, 8) and pool.values.shape == pool.keys.shape
    assert KVPool.bytes_per_block(2, 4, 8, 16, torch.bfloat16) == lm.bytes_per_block(16) // 2


def test_decode_rows_in_groups_attend_over_their_own_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows gathered one at a time (``GATHER_BYTES`` below one row) or all together attend,
    with grouped key/value heads and a window, as SDPA over each row's positions laid out
    by hand from its blocks."""
    torch.manual_seed(0)
    pool = KVPool(1, 9, 2, 3, 4, "cpu", torch.float32)
    pool.keys.normal_(), pool.values.normal_()
    tables = torch.tensor([[5, 2, 8], [1, 7, 0], [3, 0, 0]])
    positions = torch.tensor([7, 4, 1])
    q = torch.randn(3, 4, 4)
    expected = []
    for row, position in enumerate(positions.tolist()):
        first = max(0, position - 3)  # a window of 4: the position and the 3 before it
        keys, values = (torch.cat(list(t[0, tables[row]]))[first:position + 1].transpose(0, 1)
                        for t in (pool.keys, pool.values))
        expected.append(torch.nn.functional.scaled_dot_product_attention(
            q[row][:, None], keys, values, enable_gqa=True)[:, 0])
    batch = StepBatch.build([RowSpec([0], 7, [5, 2, 8]), RowSpec([0], 4, [1, 7]),
                             RowSpec([0], 1, [3])], 3)  # each row's blocks only
    together = attention.decode_attention(q, pool, 0, positions, tables, sliding_window=4)
    torch.testing.assert_close(together, torch.stack(expected))
    torch.testing.assert_close(attention.paged_attention(q, pool, 0, batch, sliding_window=4),
                               together)
    monkeypatch.setattr(attention, "GATHER_BYTES", 1)
    for alone in (attention.decode_attention(q, pool, 0, positions, tables, sliding_window=4),
                  attention.paged_attention(q, pool, 0, batch, sliding_window=4)):
        torch.testing.assert_close(alone, together)


def test_decode_rows_are_grouped_to_fit_the_gather_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Consecutive rows while their count times the widest table fits (6 blocks of one
    byte here); a row wider than the budget goes alone."""
    monkeypatch.setattr(attention, "GATHER_BYTES", 6)
    cpu = torch.device("cpu")
    assert attention.row_groups([3, 1, 2, 8, 1], 1, cpu) == [(0, 2, 3), (2, 3, 2), (3, 4, 8),
                                                         (4, 5, 1)]
    assert attention.row_groups([1] * 7, 1, cpu) == [(0, 6, 1), (6, 7, 1)]


def test_decode_rows_are_one_group_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouping bounds CPU cache traffic; on CUDA it would only add launches."""
    monkeypatch.setattr(attention, "GATHER_BYTES", 6)
    for device in (torch.device("cuda", 0), torch.device("meta")):
        assert attention.row_groups([3, 1, 2, 8, 1], 1, device) == [(0, 5, 8)]


def test_a_step_is_refused_past_the_context_or_onto_the_null_block() -> None:
    lm, _ = gpt()
    pool = lm.new_pool(16, 5)
    too_long = StepBatch.build([RowSpec([1] * 5, 62, list(range(1, 15)))], 5)
    with pytest.raises(ValueError, match="longer than the model's context"):
        lm.forward(too_long, pool)
    with pytest.raises(ValueError, match="null block"):
        StepBatch.build([RowSpec([1, 2], 0, [0])], 5)
    with pytest.raises(ValueError, match="cannot hold"):
        StepBatch.build([RowSpec([1] * 6, 0, [3])], 5)


def test_a_batch_lays_rows_flat() -> None:
    batch = StepBatch.build([RowSpec([7], 9, [4, 2]), RowSpec([1, 2, 3], 3, [5, 6], "all"),
                             RowSpec([8, 9], 0, [1], "none")], 5, max_blocks=3)
    assert batch.tokens.tolist() == [7, 1, 2, 3, 8, 9]
    assert batch.positions.tolist() == [9, 3, 4, 5, 0, 1]
    # Position 9 is offset 4 of the row's second block; 5 is offset 0 of its second.
    assert batch.slot_mapping.tolist() == [2 * 5 + 4, 5 * 5 + 3, 5 * 5 + 4, 6 * 5, 5, 6]
    assert batch.row_starts == (0, 1, 4, 6) and batch.num_decodes == 1
    assert batch.context_lens.tolist() == [10, 6, 2]
    assert batch.block_tables.tolist() == [[4, 2, 0], [5, 6, 0], [1, 0, 0]]
    assert batch.logits_at.tolist() == [0, 1, 2, 3]


@torch.inference_mode()
def test_the_compiled_decode_step_equals_eager_and_writes_the_pool_in_place() -> None:
    """The one compile of this module: ``torch.compile(dynamic=False)`` of GPT's decode
    step gives eager's logits and writes the pool it is given, as eager does."""
    lm, _ = gpt()
    prompts = [RowSpec(list(range(12)), 0, [3, 7, 2]), RowSpec(list(range(5)), 0, [9, 4])]
    pools = [lm.new_pool(16, BLOCK) for _ in range(2)]
    for pool in pools:
        lm.forward(StepBatch.build(prompts, BLOCK), pool)
    step = StepBatch.build([RowSpec([40], 12, [3, 7, 2]), RowSpec([41], 5, [9, 4])], BLOCK,
                           max_blocks=-(-lm.context // BLOCK))
    inputs = (step.tokens, step.positions, step.slot_mapping, step.block_tables)
    eager = lm.decode_step(*inputs, pools[0])
    compiled = torch.compile(lm.decode_step, dynamic=False, fullgraph=True)(*inputs, pools[1])
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pools[1].keys, pools[0].keys, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pools[1].values, pools[0].values, atol=1e-6, rtol=1e-6)
    assert pools[1].keys[:, 2, 2].any()  # position 12: block 2, offset 2
