"""One request in the engine core (``core.py``): its sequence in the scheduler, its
sampler, what it generated and what it took since the last report.

A request whose next token is still being chosen on the device (a step in flight,
``launch.py``) holds ``PENDING`` as its last token: the scheduler plans its next step
from it, the step reads the token from the device, and ``take`` puts the real one in its
place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpuflow.serve.generate.blocks import ROOT_KEY
from gpuflow.serve.generate.grammar import Guide
from gpuflow.serve.generate.lora_slots import NO_ADAPTER
from gpuflow.serve.generate.messages import Output
from gpuflow.serve.generate.paged import Wanted
from gpuflow.serve.generate.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from gpuflow.serve.generate.scheduler import Chunk, Sequence

PENDING = -1  # a token still on the device


@dataclass(eq=False)
class CoreRequest:
    """One request in the core: its sequence in the scheduler, its sampler, what it
    generated, and what it took since the last report (a request that wants its prompt's
    log-probabilities computes its whole prompt itself, so that they are exact)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    guide: Guide | None = None  # its grammar's state, when constrained (grammar.py)
    adapter: int = 0  # the LoRA adapter it runs under (0: none), and its slot once held
    slot: int = NO_ADAPTER
    generated: list[int] = field(default_factory=list)
    # The prompt's log-probabilities (None for its first token), gathered chunk by chunk.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    reported: bool = False  # its first output is out
    new_tokens: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        # An adapter's keys and values are its own: its cached blocks chain from its id.
        root = ROOT_KEY if not self.adapter else b"adapter:%d" % self.adapter
        self.seq = Sequence.of(self.prompt, self.params.prompt_logprobs is None, root)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self.sampler = Sampler(self.params, self.prompt, self.guide)
        # Whether its next token can stay on the device until a later step reads it:
        # greedy, without penalties, grammar or log-probabilities (which need the logits
        # here, or its last token: a grammar's mask depends on it). Fixed for its life.
        self.device_sampled = (self.sampler.simple_greedy and self.params.logprobs is None
                               and self.params.prompt_logprobs is None)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def wanted(self, chunk: Chunk) -> Wanted:
        """Every position's logits while ``chunk`` holds prompt tokens whose
        log-probabilities are still wanted; else the last one's if it ends the sequence."""
        scored = self.prompt_logprobs
        if scored is not None and chunk.start + chunk.length > len(scored) - 1 \
                and len(scored) < len(self.prompt):
            return "all"
        return "last" if chunk.final else "none"

    def score_prompt(self, chunk: Chunk, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens ``chunk``'s logits (``[T, V]``, every
        position) predict and that are not scored yet (a preempted sequence recomputes
        chunks already scored)."""
        scored = self.prompt_logprobs
        assert scored is not None
        first = max(chunk.start, len(scored) - 1)
        end = min(chunk.start + chunk.length, len(self.prompt) - 1)
        if end > first:
            scored += token_logprobs(logits[first - chunk.start:end - chunk.start],
                                     self.prompt[first + 1:end + 1],
                                     self.params.prompt_logprobs or 0)

    def may_go_on(self, context: int) -> bool:
        """Whether the token being chosen now may not be its last by length: only then is
        its next step planned before the token is known."""
        return (len(self.generated) + 1 < self.params.max_tokens
                and self.length + 1 < context)

    def take(self, token: int, logits: torch.Tensor | None, eos_ids: frozenset[int],
             context: int) -> str | None:
        """Take ``token`` as the sequence's next, in the place of ``PENDING`` if it holds
        one (``logits``, ``[1, V]``, the model's at its position, read only for
        log-probabilities); why the request is finished, or None."""
        params, tokens = self.params, self.seq.tokens
        pending = bool(tokens) and tokens[-1] == PENDING
        if token in eos_ids and not params.ignore_eos:
            if pending:
                tokens.pop()
            return "stop"
        self.generated.append(token)
        if pending:
            tokens[-1] = token
        else:
            tokens.append(token)
        self.sampler.observe(token)
        self.new_tokens.append(token)
        if params.logprobs is not None:
            assert logits is not None
            self.new_logprobs += token_logprobs(logits, [token], params.logprobs)
        if self.guide is not None and self.guide.complete:
            return "stop"  # the grammar's text is whole
        if len(self.generated) >= params.max_tokens or self.length >= context:
            return "length"
        return None

    def lone_token(self) -> int | None:
        """The one token it took since the last report, taken out, when that is all it has
        to say (reported before, no log-probabilities): ``Report.tokens``; else None."""
        if not self.reported or len(self.new_tokens) != 1 or self.new_logprobs:
            return None
        return self.new_tokens.pop()

    def output(self, finish: str | None = None, error: str | None = None) -> Output:
        """What it took since the last report, and its finish; the first carries the
        prompt's log-probabilities and cached tokens."""
        first = not self.reported
        self.reported = True
        out = Output(self.id, tuple(self.new_tokens), tuple(self.new_logprobs), finish, error,
                     tuple(self.prompt_logprobs) if first and self.prompt_logprobs else None,
                     self.seq.cached_tokens if first else 0)
        self.new_tokens, self.new_logprobs = [], []
        return out
