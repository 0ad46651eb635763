"""What the operator bounds the generation engine by: the ``gpuflow serve`` flags of
language models, in one value the server settings make and the engine reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLimits:
    """``max_num_seqs`` sequences run at once (``--max-batch-size``); ``max_queue`` wait
    (503 past it); the KV pool takes ``kv_cache_gib`` (None: half the GPU's free memory, a
    quarter of a CPU's RAM) in blocks of ``block_size`` tokens, full blocks cached for
    reuse unless ``prefix_caching`` is off; a step computes at most
    ``max_num_batched_tokens`` tokens, a long prompt split over steps unless
    ``chunked_prefill`` is off (then a step takes a whole prompt, up to the context).
    ``num_speculative_tokens`` (0: none) tokens are drafted for each decoding sequence and
    verified in one forward: by a draft model when one is served, else by prompt lookup
    of the sequence's last ``prompt_lookup_max`` tokens down to one. ``max_loras`` LoRA
    adapters (0: none served) of rank up to ``max_lora_rank`` are held on the device at
    once, in slots."""

    max_num_seqs: int = 32
    max_queue: int = 1024
    kv_cache_gib: float | None = None
    block_size: int = 16
    prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 3
    max_loras: int = 0
    max_lora_rank: int = 16

    def step_tokens(self, context: int) -> int:
        """Tokens a step computes at most: ``max_num_batched_tokens``, raised to cover a
        decode token of each of ``max_num_seqs`` sequences and, without chunked prefill,
        a whole ``context`` (else a longer prompt could never be admitted)."""
        floor = self.max_num_seqs if self.chunked_prefill else max(self.max_num_seqs, context)
        return max(self.max_num_batched_tokens, floor)
