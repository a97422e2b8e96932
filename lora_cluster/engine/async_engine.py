"""Asynchronous front of the engine: a loop thread steps it, callers await token streams.

All `Engine` calls happen on the loop thread; callers talk to it through a command queue, so the
engine needs no locks. Each request's outputs are pushed to the caller's asyncio queue with
`call_soon_threadsafe`. A caller that stops iterating (client disconnect, cancellation) aborts
its request, which frees the request's batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from lora_cluster.engine.llm_engine import Engine, EngineStats
from lora_cluster.engine.sampling import SamplingParams
from lora_cluster.engine.sequence import RequestOutput

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        """Stats as of the last step (read without touching the engine)."""
        return self._stats

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """Run `fn(engine)` on the loop thread and return its result (exceptions propagate)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as e:
                loop.call_soon_threadsafe(future.set_exception, e)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._commands.put(command)
        return await future

    async def load_adapter(self, adapter_id: str) -> None:
        """Fetch and validate an adapter without blocking the loop thread; raises its AdapterError."""
        future = await self.call(lambda engine: engine.start_load(adapter_id))
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            await self.call(lambda engine: engine.forget_failed_load(adapter_id))
            raise

    async def unload_adapter(self, adapter_id: str) -> bool:
        return await self.call(lambda engine: engine.unload_adapter(adapter_id))

    async def generate(
        self,
        prompt: str | list[int],
        adapter_id: str | None = None,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request; raises its error (bad input, failed adapter) instead."""
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream

        def add(engine: Engine) -> None:
            engine.add_request(request_id, prompt, adapter_id, sampling)

        try:
            await self.call(add)
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
                self._commands.put(lambda: self.engine.abort(request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        stream = self._streams.get(request_id)
        if out is not None and stream is not None:
            stream.put(out)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                command = self._commands.get(timeout=None if not self.engine.has_unfinished() else 0)
            except queue.Empty:
                command = None
            if command is not None:
                command()
                self._stats = self.engine.stats()
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine step failed")
                continue
            self._stats = self.engine.stats()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=5)
        self.engine.close()
