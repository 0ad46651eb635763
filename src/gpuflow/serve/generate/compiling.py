"""Constrained requests whose grammar the engine core has not compiled yet: compiled in a
thread of their own (llguidance drops the GIL), so that a long compile holds up no step.
Such a request waits here, outside the scheduler, until its guide is ready; one whose
grammar is cached is ready at once."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from gpuflow.serve.generate.grammar import GrammarError, Grammars, Guide, Vocabulary
from gpuflow.serve.generate.messages import NewRequest


class GrammarQueue:
    """The core's grammars (once the vocabulary came) and the requests waiting on them."""

    def __init__(self) -> None:
        self.grammars: Grammars | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._waiting: dict[int, tuple[NewRequest, Future[Guide]]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, vocabulary: Vocabulary, eos_ids: Iterable[int]) -> None:
        self.grammars = Grammars(vocabulary, eos_ids)

    def submit(self, new: NewRequest) -> None:
        """Compile the request's grammar, now when cached, else in the background."""
        assert new.params.constraint is not None
        constraint, grammars = new.params.constraint, self.grammars
        future: Future[Guide] = Future()
        if grammars is None:
            future.set_exception(GrammarError("a grammar came before the vocabulary"))
        elif grammars.is_cached(constraint):
            future.set_result(grammars.guide(constraint))
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="gpuflow-grammar")
            future = self._executor.submit(grammars.guide, constraint)
        self._waiting[new.id] = (new, future)

    def ready(self) -> list[tuple[NewRequest, Guide | None, str | None]]:
        """The requests whose grammar is compiled, in the order they came: each with its
        guide, or why its grammar does not compile."""
        done = []
        for request_id, (new, future) in list(self._waiting.items()):
            if future.done():
                del self._waiting[request_id]
                try:
                    done.append((new, future.result(), None))
                except GrammarError as exc:
                    done.append((new, None, f"the grammar does not compile: {exc}"))
        return done

    def wait(self, timeout: float) -> None:
        """Until a compile finishes, or ``timeout`` seconds (the core has nothing else)."""
        wait([future for _, future in self._waiting.values()], timeout,
             return_when=FIRST_COMPLETED)

    def drop(self, request_id: int) -> bool:
        """Forget a waiting request (its client left); whether it was waiting here."""
        return self._waiting.pop(request_id, None) is not None

    def clear(self) -> list[NewRequest]:
        waiting, self._waiting = self._waiting, {}
        return [new for new, _ in waiting.values()]

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
