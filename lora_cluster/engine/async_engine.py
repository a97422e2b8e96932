"""Asynchronous front of the engine: a loop thread steps it, callers await token streams.

All `Engine` calls that touch its state happen on the loop thread; callers talk to it through a
command queue, so the engine needs no locks. Each request's outputs are pushed to the caller's
asyncio queue with `call_soon_threadsafe`. A caller that stops iterating (client disconnect,
cancellation) aborts its request, which frees the request's batch slot at the next step. The
adapter catalog (register, unregister, list, merge) is not the engine's: the caller talks to the
store it wired (`store.ports.AdapterCatalog`), and asks `check_open` first where a stopped loop
must refuse the call.

Lifecycle: RUNNING -> CLOSED. `shutdown` stops the loop first and closes the engine only once the
loop thread has exited. When the loop exits, for whatever reason, every waiting caller gets an
`EngineUnavailableError` (queued commands and open streams alike), and so does every later
caller: nobody waits on a loop that is gone. `check_health` raises while the loop is gone or while
steps keep failing (`max_consecutive_step_failures` in a row), so that Ray Serve restarts the
replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from lora_cluster.engine.llm_engine import Engine, EngineStats
from lora_cluster.errors import EngineUnavailableError
from lora_cluster.request.output import RequestOutput
from lora_cluster.request.sampling_params import SamplingParams

log = logging.getLogger(__name__)

IDLE_FETCH_POLL_S = 0.05  # while idle with adapter fetches held, step this often to let them go


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's event loop is closed: nobody listens
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Command:
    run: Callable[[], None]
    fail: Callable[[BaseException], None]


def _ignore(_: BaseException) -> None:
    pass


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_consecutive_step_failures: int | None = None,
                 on_step: Callable[[EngineStats], None] | None = None):
        """`on_step(stats)` runs on the engine's thread after every step (it must be quick and must
        not touch the engine; an error it raises is logged, and the loop goes on)."""
        self.engine = engine
        self._on_step = on_step
        self.max_consecutive_step_failures = (
            max_consecutive_step_failures or engine.config.max_consecutive_step_failures
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # orders `_submit` against the loop's exit
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """Stats as of the last step (read without touching the engine)."""
        return self._stats

    # ----- commands -------------------------------------------------------------------------

    def _submit(self, command: _Command) -> None:
        with self._lock:
            if self._closed:
                raise EngineUnavailableError("the engine loop has stopped")
            self._commands.put(command)

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the loop thread and return its result (exceptions propagate).
        Raises EngineUnavailableError when the loop has stopped or stops before running it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(setter: Callable[[Any], None], value: object) -> None:
            if not future.done():
                setter(value)

        def fail(error: BaseException) -> None:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
                loop.call_soon_threadsafe(settle, future.set_exception, error)

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:
                fail(e)
            else:
                loop.call_soon_threadsafe(settle, future.set_result, result)

        self._submit(_Command(run, fail))
        return await future

    def _post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread, fire and forget (nothing to do if the loop is gone)."""
        with contextlib.suppress(EngineUnavailableError):
            self._submit(_Command(fn, _ignore))

    # ----- adapters -------------------------------------------------------------------------

    async def load_adapter(self, adapter_id: str) -> None:
        """Fetch and validate an adapter without blocking the loop thread; raises its AdapterError."""
        future = await self.call(lambda engine: engine.start_load(adapter_id))
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            await self.call(lambda engine: engine.forget_failed_load(adapter_id))
            raise

    async def unload_adapter(self, adapter_id: str) -> bool:
        """Drop the adapter from the device and host; False while a request uses it."""
        return await self.call(lambda engine: engine.unload_adapter(adapter_id))

    # ----- requests -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        adapter_id: str | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        preempt_after_s: float = 0.0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request (`priority`: lower is more urgent; `preempt_after_s`: its
        patience before it preempts, see `Engine.add_request`); raises its error (bad input, failed
        adapter) instead."""
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt, adapter_id, sampling, priority, preempt_after_s)

        try:
            await self.call(add)
        except asyncio.CancelledError:
            # the caller went away while the add was queued: the loop thread still runs the add, then
            # this abort (commands run in order), so no request generates for a caller that is gone
            self._streams.pop(request_id, None)
            self._post(lambda: self.engine.abort(request_id))
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    raise item.error
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        stream = self._streams.get(request_id)
        if out is not None and stream is not None:
            stream.put(out)

    # ----- health and lifecycle -------------------------------------------------------------

    def check_open(self) -> None:
        """Raise EngineUnavailableError once the loop has stopped (closed, or its thread is gone)."""
        if self._closed or not self._thread.is_alive():
            raise EngineUnavailableError("the engine loop has stopped")

    def check_health(self) -> None:
        """Raise EngineUnavailableError when the loop is gone or steps keep failing."""
        self.check_open()
        failures = self._stats.consecutive_step_failures
        if failures >= self.max_consecutive_step_failures:
            raise EngineUnavailableError(
                f"the last {failures} engine steps failed "
                f"(max_consecutive_step_failures={self.max_consecutive_step_failures})"
            )

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._iterate()
        except BaseException:
            log.exception("the engine loop stopped on an unexpected error")
        finally:
            self._close_loop()

    def _iterate(self) -> None:
        engine = self.engine
        if engine.has_unfinished():
            timeout: float | None = 0
        elif engine.has_fetches():
            timeout = IDLE_FETCH_POLL_S
        else:
            timeout = None
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            command = None
        if command is not None:
            command.run()
            self._stats = engine.stats()
            return
        outputs = engine.step()
        self._stats = engine.stats()
        if self._on_step is not None:
            try:
                self._on_step(self._stats)
            except Exception:
                log.exception("the engine's step observer failed")
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _close_loop(self) -> None:
        self._refuse_all(EngineUnavailableError("the engine loop has stopped"))

    def _refuse_all(self, error: EngineUnavailableError) -> None:
        """Refuse new commands; fail the queued ones and every open stream with `error`."""
        with self._lock:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command.fail(error)
        for stream in list(self._streams.values()):
            stream.put(error)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop, then close the engine. If the loop does not stop within `timeout_s`
        (a step that hangs), the engine is left open rather than closed under a running step."""
        self._stop.set()
        self._post(lambda: None)  # wake the loop if it idles
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the engine loop did not stop within %.0f s; the engine stays open", timeout_s)
            self._refuse_all(EngineUnavailableError("the engine is shutting down"))
            return
        self.engine.close()
