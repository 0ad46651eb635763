"""The generation engine assembled: the served model's paged view, a KV pool sized from the
memory budget, the block manager, the scheduler and the model runner, under the operator's
``EngineLimits``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gpuflow.errors import UserError
from gpuflow.serve.generate.blocks import BlockManager
from gpuflow.serve.generate.budget import default_cache_budget, pool_blocks
from gpuflow.serve.generate.draft import DraftModel
from gpuflow.serve.generate.engine import GenerationEngine
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.models import paged_lm, refusal
from gpuflow.serve.generate.paged import PagedLM
from gpuflow.serve.generate.requests import EngineObserver
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.scheduler import Scheduler
from gpuflow.serve.generate.speculate import PromptLookup, Proposer
from gpuflow.serve.generate.tokenizer import Tokenizer

log = logging.getLogger("gpuflow.serve")


def build_engine(lm: PagedLM, num_blocks: int, limits: EngineLimits,
                 context: Callable[[], contextlib.AbstractContextManager[Any]],
                 bucketed: bool = False, compile: bool = False, cuda_graphs: bool = False,
                 draft: PagedLM | None = None, max_autotune: bool = False,
                 **options: Any) -> GenerationEngine:
    """An engine over a pool of ``num_blocks`` blocks (the null block among them);
    ``options`` are the engine's own (tokenizer, eos_ids, observer). A step's token
    budget is ``limits.step_tokens``, logged when it raises the operator's. With
    ``limits.num_speculative_tokens``, tokens are drafted by ``draft`` (a pool of its own
    as large) or, without one, by prompt lookup."""
    tokens = limits.step_tokens(lm.context)
    if tokens != limits.max_num_batched_tokens:
        log.info("gpuflow serve: --max-num-batched-tokens raised from %d to %d: a step "
                 "holds %s", limits.max_num_batched_tokens, tokens,
                 "a decode token of each of --max-batch-size sequences"
                 if tokens == limits.max_num_seqs else
                 "a whole context when prefill is not chunked")
    blocks = BlockManager(num_blocks, limits.block_size, limits.prefix_caching)
    scheduler = Scheduler(blocks, limits.max_num_seqs, tokens, limits.chunked_prefill,
                          limits.num_speculative_tokens, lm.context)
    runner = ModelRunner(lm, num_blocks, limits.block_size, limits.max_num_seqs, bucketed,
                         compile, cuda_graphs, max_autotune)
    proposer: Proposer | None = None
    if limits.num_speculative_tokens:
        proposer = (PromptLookup(limits.prompt_lookup_max) if draft is None else
                    DraftModel(ModelRunner(draft, num_blocks, limits.block_size,
                                           limits.max_num_seqs)))
    return GenerationEngine(lm, scheduler, runner, limits.max_queue, context,
                            proposer=proposer, **options)


def build_generator(model: torch.nn.Module, runner: Any, limits: EngineLimits,
                    observer: EngineObserver | None, tokenizer: Tokenizer | None = None,
                    eos_ids: Iterable[int] = (), context: int | None = None,
                    draft_model: torch.nn.Module | None = None,
                    decode_graphs: bool = False,
                    max_autotune: bool = False) -> GenerationEngine | None:
    """A generation engine for the served model on the runner's device and precision, its
    decode steps compiled (and on CUDA replayed as graphs) when the runner's model is, or
    on CUDA when ``decode_graphs`` asks for graphs, compiled with kernel tuning when
    ``max_autotune`` asks, or None for a model that does not generate text.
    ``tokenizer`` (default: bytes) and ``eos_ids`` are the model's; ``context`` caps its
    sequences' length; ``draft_model`` (on the same device) drafts tokens for speculative
    decoding."""
    dtype = runner.policy.autocast_dtype or torch.float32
    lm = paged_lm(model, dtype, tokenizer is not None, context)
    if lm is None:
        log.info("gpuflow serve: no /v1/completions: %s", refusal(model, tokenizer is not None))
        return None
    draft = None if draft_model is None else _draft_lm(draft_model, lm, dtype,
                                                      tokenizer is not None)
    budget = (int(limits.kv_cache_gib * 2**30) if limits.kv_cache_gib is not None
              else default_cache_budget(runner.device))
    per_block = lm.bytes_per_block(limits.block_size) + (
        0 if draft is None else draft.bytes_per_block(limits.block_size))
    blocks = pool_blocks(per_block, budget, limits.block_size, lm.context, limits.max_num_seqs)
    graphs = runner.cuda_graphs or (decode_graphs and runner.device.type == "cuda")
    return build_engine(lm, blocks, limits, runner.context, compile=runner.compiled or graphs,
                        cuda_graphs=graphs, draft=draft, max_autotune=max_autotune,
                        tokenizer=tokenizer, eos_ids=eos_ids, observer=observer)


def _draft_lm(model: torch.nn.Module, lm: PagedLM, dtype: torch.dtype,
              tokenized: bool) -> PagedLM:
    """The engine's view of a draft model, refused unless it can draft for ``lm``: a causal
    LM the engine drives, with the same vocabulary, over at least the same context."""
    draft = paged_lm(model, dtype, tokenized, lm.context)
    if draft is None:
        raise UserError(f"--draft-model cannot draft: {refusal(model, tokenized)}.")
    if draft.vocab_size != lm.vocab_size:
        raise UserError(f"--draft-model has a vocabulary of {draft.vocab_size} tokens and the "
                        f"served model one of {lm.vocab_size}: a draft model must share the "
                        "served model's tokenizer.")
    if draft.context < lm.context:
        raise UserError(f"--draft-model's context ({draft.context} tokens) is shorter than the "
                        f"served model's ({lm.context}); lower --max-model-len to it.")
    return draft
