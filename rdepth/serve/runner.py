"""The engine behind a server: one thread owns the :class:`~rdepth.engine.Engine` and ticks it while
requests are in flight; clients on other threads (the server's event loop) submit requests and get their
tokens as they come.

The bridge to asyncio holds no thread per waiting request: a request's choices share one :class:`Inbox`, an
``asyncio.Queue`` on the event loop that made it, and the engine's thread posts into it with
``loop.call_soon_threadsafe``, once per tick for every event of that tick (a token, a result), so the event
loop wakes once a tick however many tokens the tick chose. A caller without an event loop reads a
:class:`Submission`'s own thread-safe ``events`` queue instead.

Every request in flight shares the engine's batch; each one's tokens equal its batch-1 decode under the
same policy, threshold, noise and seed (the engine's guarantee, tests/test_engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from rdepth.engine import Engine, Finished, Request
from rdepth.engine.request import TokenLogprob
from rdepth.errors import RdepthError

log = logging.getLogger(__name__)
REFUSED = -1  # the id of a request the engine refused (add_request raised): it ended at once, with its error


@dataclass
class TokenEvent:
    """One new token of a request: its id, the loop steps per group of the position that chose it, why each
    group's loop stopped (``"rule"`` or ``"budget"``) and, where the request asks for them, its log-probabilities."""

    token: int
    steps: list[int]
    rules: list[str]
    logprob: TokenLogprob | None = None


@dataclass
class EngineFailed:
    """The last event of every request once the engine's thread has failed (an exception out of a tick): the
    server's fault, which no request outlives."""

    message: str


Event = TokenEvent | Finished | EngineFailed


class Inbox:
    """The events of one HTTP request's choices, ``(choice, event)``, in one ``asyncio.Queue`` on the running
    event loop (make it on the loop that reads it)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def get(self) -> tuple[int, Event]:
        return await self.queue.get()


@dataclass
class Submission:
    """A submitted request: its events (:class:`TokenEvent` s, then the :class:`Finished` result or
    :class:`EngineFailed`) go into ``inbox`` tagged ``choice``, or, without an inbox, into ``events`` (a thread-safe
    queue made for it then)."""

    request: Request
    inbox: Inbox | None = None
    choice: int = 0
    events: queue.Queue[Event] | None = None  # (made only without an inbox: a Queue builds three locks)
    request_id: int | None = None

    def __post_init__(self) -> None:
        if self.inbox is None and self.events is None:
            self.events = queue.Queue()


def _deliver(items: list[tuple[Inbox, int, Event]]) -> None:
    """On the event loop: a tick's events into their inboxes, in the order the engine made them."""
    for inbox, choice, event in items:
        inbox.queue.put_nowait((choice, event))


class EngineRunner:
    """Owns ``engine`` on a background thread (started by :meth:`start`, ended by :meth:`stop`)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        engine.listener = self._on_token
        self._inbox: queue.Queue[Submission] = queue.Queue()
        self._cancels: queue.Queue[Submission] = queue.Queue()
        self._unresolved: list[Submission] = []  # cancelled before the engine's thread gave them an id
        self._by_id: dict[int, Submission] = {}
        self._outbox: list[tuple[Inbox, int, Event]] = []  # this tick's events for inboxes, posted after it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_s = time.time()
        self.metrics = {"requests": 0, "requests_failed": 0, "tokens_generated": 0}
        self._lock = threading.Lock()
        self.failure: str | None = None  # set when the engine's thread failed

    # ------------------------------------------------------------------ clients (any thread)
    def submit(self, request: Request, inbox: Inbox | None = None, choice: int = 0) -> Submission:
        submission = Submission(request, inbox, choice)
        self._inbox.put(submission)
        self._wake.set()
        if self.failure is not None:  # after the put: the failed thread's own sweep may have missed it
            self._fail_inbox()
        return submission

    def cancel(self, submission: Submission) -> None:
        """End ``submission`` at the engine's next tick, its slot freed (queued, in flight, or not yet taken by
        the engine's thread; the engine's thread resolves it, so a cancel made just after the submit is never
        dropped)."""
        self._cancels.put(submission)
        self._wake.set()

    def queue_length(self) -> int:
        return self._inbox.qsize() + len(self.engine.queue)

    def snapshot(self) -> dict:
        """The counters, the queue length and the slots in use (for /metrics)."""
        with self._lock:
            metrics = dict(self.metrics)
        stats = self.engine.stats  # ints the engine's thread updates (each read is atomic)
        metrics.update(queue=self.queue_length(), in_flight=self.engine.in_flight(), batch=self.engine.batch,
                       uptime_s=time.time() - self.started_s, ticks=stats.ticks, positions=stats.positions,
                       occupied_slot_ticks=stats.occupied, loop_steps=list(stats.loop_steps),
                       speculation_rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted)
        return metrics

    # ------------------------------------------------------------------ the engine's thread
    def start(self) -> EngineRunner:
        self._thread = threading.Thread(target=self._loop, name="rdepth-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._take_inbox()
                if not engine.pending():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for done in engine.step():
                    self._finish(done)
                self._flush()
        except Exception as exc:  # the engine's state is unknown now: every request, now and later, fails
            log.error("the engine's thread failed; every request now fails (restart the server)",
                      exc_info=(type(exc), exc, exc.__traceback__))
            self.failure = f"the engine failed ({type(exc).__name__}); restart the server"
            self._flush()
            for submission in self._by_id.values():
                self._post_now(submission, EngineFailed(self.failure))
            self._by_id.clear()
            self._fail_inbox()

    def _post(self, submission: Submission, event: Event) -> None:
        """An event of this tick (the engine's thread): posted with the tick's others by :meth:`_flush`."""
        if submission.inbox is None:
            submission.events.put(event)
        else:
            self._outbox.append((submission.inbox, submission.choice, event))

    def _flush(self) -> None:
        """The tick's events to their event loops: one ``call_soon_threadsafe`` per loop."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for item in self._outbox:
            by_loop.setdefault(item[0].loop, []).append(item)
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to read them
                loop.call_soon_threadsafe(_deliver, items)

    @staticmethod
    def _post_now(submission: Submission, event: Event) -> None:
        if submission.inbox is None:
            submission.events.put(event)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop
            submission.inbox.loop.call_soon_threadsafe(_deliver, [(submission.inbox, submission.choice, event)])

    def _fail_inbox(self) -> None:
        while True:
            try:
                self._post_now(self._inbox.get_nowait(), EngineFailed(self.failure))
            except queue.Empty:
                return

    def _take_inbox(self) -> None:
        while True:
            try:
                submission = self._inbox.get_nowait()
            except queue.Empty:
                break
            try:
                submission.request_id = self.engine.add_request(submission.request)
            except RdepthError as exc:  # a request the engine refuses (its depth): it ends, the engine goes on
                submission.request_id = REFUSED
                self._post_now(submission, Finished(REFUSED, submission.request, finish_reason="error",
                                                    error=str(exc)))
                continue
            self._by_id[submission.request_id] = submission
        cancels, self._unresolved = self._unresolved, []
        while True:
            try:
                cancels.append(self._cancels.get_nowait())
            except queue.Empty:
                break
        for submission in cancels:  # one submitted after the inbox was read waits for the next round
            if submission.request_id is None:
                self._unresolved.append(submission)
            elif submission.request_id != REFUSED:
                self.engine.cancel(submission.request_id)

    def _on_token(self, request_id: int, token: int, steps: list[int], rules: list[str],
                  logprob: TokenLogprob | None = None) -> None:
        submission = self._by_id.get(request_id)
        with self._lock:
            self.metrics["tokens_generated"] += 1
        if submission is not None:
            self._post(submission, TokenEvent(token, steps, rules, logprob))

    def _finish(self, done: Finished) -> None:
        submission = self._by_id.pop(done.request_id, None)
        with self._lock:
            self.metrics["requests"] += 1
            if done.error is not None:
                self.metrics["requests_failed"] += 1
        if submission is not None:
            self._post(submission, done)
