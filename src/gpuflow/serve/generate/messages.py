"""What crosses between the server and the engine core (``core.py``), in the server's own
thread or between two processes (``link.py``): plain frozen data that pickles, one
``Inbox`` to the core and one ``Report`` back per step, not one message per token."""

from __future__ import annotations

from dataclasses import dataclass

from gpuflow.serve.generate.adapter_files import AdapterRef
from gpuflow.serve.generate.grammar import Vocabulary
from gpuflow.serve.generate.sampling import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Occupancy:
    """The engine after a step: sequences running and waiting, KV blocks in use of those
    sequences can hold, preemptions so far, prompt tokens looked up in the prefix cache so
    far and found there, and tokens drafted for speculative decoding so far and accepted."""

    running: int
    waiting: int
    blocks_used: int
    blocks_total: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class StepTiming:
    """One engine step: its rows (sequences) and scheduled tokens (drafts not counted), the
    seconds the model runner's call took (on a GPU, launching its work: the device
    finishes while the tokens are chosen) and the whole step's (scheduling
    excluded: sampling, stop checks and events included); ``graphed``: the forward
    replayed a CUDA graph; ``mask_s``: the seconds its grammars' token masks took."""

    rows: int
    tokens: int
    forward_s: float
    step_s: float
    graphed: bool = False
    mask_s: float = 0.0


@dataclass(frozen=True)
class NewRequest:
    """A request as it crosses to the core: its id, prompt ids and sampling, and the LoRA
    adapter it runs under (``AdapterRef.id``; 0: the base model alone)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    adapter: int = 0


@dataclass(frozen=True)
class Inbox:
    """What the server sends the core between two steps, all at once; the first to hold
    a constrained request carries the vocabulary its grammars compile against. Adapters
    registered and unregistered since the last come first, before the requests."""

    new: tuple[NewRequest, ...] = ()
    dropped: tuple[int, ...] = ()  # ids whose client left, or that a stop string ended
    vocabulary: Vocabulary | None = None
    adapters: tuple[AdapterRef, ...] = ()
    unregistered: tuple[int, ...] = ()  # adapter ids


@dataclass(frozen=True)
class Output:
    """One request's share of a step: the tokens it took (an end-of-sequence id that ended
    it left out), their log-probabilities when asked, and why the core ended it
    (``stop``, ``length``, ``cancelled``, or ``failed`` with ``error``). Its first output
    carries the prompt's log-probabilities when asked, and the prompt tokens found
    cached."""

    id: int
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish: str | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class Report:
    """One step as the core reports it: its outputs, the engine after it, the requests the
    core has taken in so far (the server counts the rest as waiting), and the timing of
    the steps whose tokens it took (none for drops alone; two where a step left in flight
    and the one after it were both taken).

    Most rows of most steps took one token and have nothing else to say: those come as
    two columns, ``token_ids[i]`` took ``tokens[i]``, not as ``Output`` objects (two tuples
    of ints cross a pipe in a fraction of the time as many objects take)."""

    outputs: tuple[Output, ...]
    occupancy: Occupancy
    taken: int
    timings: tuple[StepTiming, ...] = ()
    token_ids: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class Ready:
    """The core after its warm-up: how decode steps run, its pool's and scheduler's limits
    (for /readyz), and the seconds the warm-up took."""

    decode: str
    limits: dict[str, object]
    warmup_s: float


@dataclass(frozen=True)
class WarmUpFailed:
    """The core could not be built or warmed up: why, and whether it is the user's to fix
    (``gpuflow.errors.UserError``)."""

    message: str
    user_error: bool = False
