"""The generation engine assembled: the served model's paged view, a KV pool sized from the
memory budget, the block manager, the scheduler and the model runner, under the operator's
``EngineLimits``; the core in the server's thread (``build_engine``) or, from an
``EngineSpec``, in a process of its own (``build_generator``, as ``gpuflow serve`` runs)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpuflow.errors import UserError
from gpuflow.precision import PrecisionPolicy, make_policy
from gpuflow.serve import dtypes
from gpuflow.serve.generate.blocks import BlockManager
from gpuflow.serve.generate.budget import default_cache_budget, pool_blocks
from gpuflow.serve.generate.core import EngineCore
from gpuflow.serve.generate.draft import DraftModel
from gpuflow.serve.generate.engine import GenerationEngine, Link
from gpuflow.serve.generate.limits import EngineLimits
from gpuflow.serve.generate.link import Context, ProcessLink, ThreadLink
from gpuflow.serve.generate.lora_slots import LoraSlots, SlotTable
from gpuflow.serve.generate.models import paged_lm, refusal
from gpuflow.serve.generate.paged import PagedLM
from gpuflow.serve.generate.requests import EngineObserver
from gpuflow.serve.generate.runner import ModelRunner
from gpuflow.serve.generate.scheduler import Scheduler
from gpuflow.serve.generate.speculate import PromptLookup, Proposer
from gpuflow.serve.generate.tokenizer import Tokenizer

log = logging.getLogger("gpuflow.serve")


def build_core(lm: PagedLM, num_blocks: int, limits: EngineLimits, bucketed: bool = False,
               compile: bool = False, cuda_graphs: bool = False, draft: PagedLM | None = None,
               max_autotune: bool = False, eos_ids: Iterable[int] = ()) -> EngineCore:
    """A core over a pool of ``num_blocks`` blocks (the null block among them), with
    ``limits.max_loras`` slots for LoRA adapters beside ``lm``'s weights. A step's
    token budget is ``limits.step_tokens``, logged when it raises the operator's. With
    ``limits.num_speculative_tokens``, tokens are drafted by ``draft`` (a pool of its own
    as large) or, without one, by prompt lookup."""
    tokens = limits.step_tokens(lm.context)
    if tokens != limits.max_num_batched_tokens:
        log.info("gpuflow serve: --max-num-batched-tokens raised from %d to %d: a step "
                 "holds %s", limits.max_num_batched_tokens, tokens,
                 "a decode token of each of --max-batch-size sequences"
                 if tokens == limits.max_num_seqs else
                 "a whole context when prefill is not chunked")
    adapters = None
    if limits.max_loras:
        adapters = SlotTable(_attach_adapters(lm, limits))
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
    return EngineCore(scheduler, runner, lm.context, eos_ids, proposer,
                      overlap=steps_overlap(runner.device), adapters=adapters)


def _attach_adapters(lm: PagedLM, limits: EngineLimits) -> LoraSlots:
    """The slots of ``limits.max_loras`` adapters in ``lm``'s forward (the server refuses
    adapters for a model whose forward takes none, before the core is built)."""
    from gpuflow.serve.generate.llama import LlamaDecoder  # imports transformers

    assert isinstance(lm, LlamaDecoder), "the server refuses adapters for this model"
    slots = lm.attach_adapters(limits.max_loras, limits.max_lora_rank)
    log.info("gpuflow serve: %d LoRA adapter slots of rank %d: %.1f MiB", slots.slots,
             slots.rank, slots.nbytes() / 2**20)
    return slots


def steps_overlap(device: torch.device) -> bool:
    """Whether a step's forward can run beside the core's host work, so that leaving greedy
    steps in flight pays (``launch.py``): on an accelerator, or on a CPU with a core beyond
    torch's threads. Without one, planning the next step over an unfinished one only
    delays a new request by a step: its first token waits for two steps, not one."""
    if device.type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) > torch.get_num_threads()


def build_engine(lm: PagedLM, num_blocks: int, limits: EngineLimits, context: Context,
                 bucketed: bool = False, compile: bool = False, cuda_graphs: bool = False,
                 draft: PagedLM | None = None, max_autotune: bool = False,
                 eos_ids: Iterable[int] = (), tokenizer: Tokenizer | None = None,
                 observer: EngineObserver | None = None) -> GenerationEngine:
    """An engine whose core runs in a thread of this process, under ``context``."""
    core = build_core(lm, num_blocks, limits, bucketed, compile, cuda_graphs, draft,
                      max_autotune, eos_ids)
    return GenerationEngine(ThreadLink(core, context), lm.context, lm.vocab_size,
                            limits.max_queue, tokenizer, observer)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine core is built from, in the server's process or in one of its own
    (it pickles: the models' weights cross as shared memory or CUDA IPC handles). The
    models are on ``device``, their weights in their serving dtype; ``precision`` is the
    served model's autocast policy, applied when ``autocast`` (weights in fp32); the KV
    cache is in ``kv_dtype``."""

    model: torch.nn.Module
    device: str
    precision: str
    autocast: bool
    kv_dtype: torch.dtype
    limits: EngineLimits
    tokenized: bool
    context: int | None
    eos_ids: tuple[int, ...]
    draft_model: torch.nn.Module | None = None
    compile: bool = False
    cuda_graphs: bool = False
    max_autotune: bool = False
    threads: int | None = None

    def views(self) -> tuple[PagedLM | None, PagedLM | None]:
        """The engine's views of the model and the draft model (the model's None when the
        engine cannot drive it; a draft that cannot draft for it is refused)."""
        lm = paged_lm(self.model, self.kv_dtype, self.tokenized, self.context)
        if lm is None or self.draft_model is None:
            return lm, None
        return lm, _draft_lm(self.draft_model, lm, self.kv_dtype, self.tokenized)

    def build(self) -> tuple[EngineCore, Context]:
        """The core, and the context its steps run under (inference mode, autocast)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        lm, draft = self.views()
        assert lm is not None, "the server refuses a model the engine cannot drive"
        for view in (lm, draft) if not self.compile else ():
            if view is not None:
                view.prepack()
        limits, device = self.limits, torch.device(self.device)
        budget = (int(limits.kv_cache_gib * 2**30) if limits.kv_cache_gib is not None
                  else default_cache_budget(device))
        per_block = lm.bytes_per_block(limits.block_size) + (
            0 if draft is None else draft.bytes_per_block(limits.block_size))
        blocks = pool_blocks(per_block, budget, limits.block_size, lm.context,
                             limits.max_num_seqs)
        core = build_core(lm, blocks, limits, compile=self.compile,
                          cuda_graphs=self.cuda_graphs, draft=draft,
                          max_autotune=self.max_autotune, eos_ids=self.eos_ids)
        policy = make_policy(self.precision, device) if self.autocast else None
        return core, lambda: _inference(policy)


@contextlib.contextmanager
def _inference(policy: PrecisionPolicy | None) -> Iterator[None]:
    with torch.inference_mode(), (contextlib.nullcontext() if policy is None
                                  else policy.autocast()):
        yield


def build_generator(model: torch.nn.Module, runner: Any, limits: EngineLimits,
                    observer: EngineObserver | None, tokenizer: Tokenizer | None = None,
                    eos_ids: Iterable[int] = (), context: int | None = None,
                    draft_model: torch.nn.Module | None = None,
                    decode_graphs: bool = False, max_autotune: bool = False,
                    engine_process: bool = False, threads: int | None = None,
                    kv_cache_dtype: str = "auto") -> GenerationEngine | None:
    """A generation engine for the served model on the runner's device and precision, its
    decode steps compiled (and on CUDA replayed as graphs) when the runner's model is, or
    on CUDA when ``decode_graphs`` asks for graphs, compiled with kernel tuning when
    ``max_autotune`` asks, or None for a model that does not generate text.
    ``tokenizer`` (default: bytes) and ``eos_ids`` are the model's; ``context`` caps its
    sequences' length; ``draft_model`` (on the same device) drafts tokens for speculative
    decoding. ``engine_process``: the core in a process of its own (``threads`` torch
    threads there), else in a thread of this one. The KV cache is in ``kv_cache_dtype``
    (``serve/dtypes.py``)."""
    graphs = runner.cuda_graphs or (decode_graphs and runner.device.type == "cuda")
    kv_dtype = dtypes.kv_cache_dtype(kv_cache_dtype, runner.dtype, runner.policy.name)
    spec = EngineSpec(model, str(runner.device), runner.policy.name, runner.autocast,
                      kv_dtype, limits, tokenizer is not None, context, tuple(eos_ids),
                      draft_model, runner.compiled or graphs, graphs, max_autotune, threads)
    lm, _ = spec.views()
    if lm is None:
        log.info("gpuflow serve: no /v1/completions: %s", refusal(model, tokenizer is not None))
        return None
    link: Link
    if engine_process:
        link = ProcessLink(spec)
    else:
        core, core_context = spec.build()
        link = ThreadLink(core, core_context)
    return GenerationEngine(link, lm.context, lm.vocab_size, limits.max_queue, tokenizer,
                            observer)


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
