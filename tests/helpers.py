"""Small shared pieces of the tests: bounded waits, a fake clock, a fake adapter loader, the greedy
sampling parameters, PEFT's logits, a script of the repository loaded as a module, `serve run`.

Every wait is bounded: the bound is a safety net reached only when the behaviour under test is broken,
never a performance figure (a wait that runs out fails with the message of what it waited for).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from lora_cluster.engine import SamplingParams
from lora_cluster.store.ports import StatelessHooks

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

T = TypeVar("T")


ROOT = Path(__file__).resolve().parent.parent


def script_module(relative_path: str, name: str) -> Iterator[ModuleType]:
    """A script of the repository that is not in a package (`benchmarks/common.py`,
    `load_tests/soak.py`) loaded as the module `name`, for a fixture to yield (removed afterwards)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(name, None)


class FakeResponse:
    """A Ray call's response in a test: awaiting it gives `outcome`, or raises it when it is an
    exception; `cancel()` is recorded in `cancelled`."""

    def __init__(self, outcome: Any):
        self.outcome, self.cancelled = outcome, False

    def __await__(self):
        async def result() -> Any:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return result().__await__()

    def cancel(self) -> None:
        self.cancelled = True


def poll(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.2) -> T:
    """Call `predicate` until it returns a true value (returned) or `timeout_s` has passed (its last,
    false, value is returned). It is called at least once, and once more after the bound."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(interval_s)
    return value


def wait_until(predicate: Callable[[], T], timeout_s: float, message: str, interval_s: float = 0.2) -> T:
    """`predicate`'s first true value; an AssertionError naming `message` when none came in `timeout_s`."""
    value = poll(predicate, timeout_s, interval_s)
    assert value, f"gave up after {timeout_s:g} s waiting for {message} (last: {value!r})"
    return value


async def wait_until_async(predicate: Callable[[], Any], timeout_s: float, message: str,
                           interval_s: float = 0.01) -> Any:
    """`wait_until` on an event loop: `predicate` may be a coroutine function; the loop keeps running
    between calls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up after {timeout_s:g} s waiting for {message}"
        await asyncio.sleep(interval_s)


class FakeClock:
    """A monotonic clock that moves only when the test moves it (`advance`, or `sleep` where the code
    under test sleeps on the clock it is given)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    sleep = advance


class FakeLoader(StatelessHooks, ABC):
    """An `EnginePort` (`store.ports`: what an engine is wired with) with nothing behind it: a
    subclass supplies `load` (weights for any id) and overrides the hooks its test watches."""

    @abstractmethod
    def load(self, adapter_id: str) -> Any:
        """Weights for `adapter_id` (each test's subclass makes them)."""

    def version(self, adapter_id: str) -> int:
        return 0



def greedy(max_new_tokens: int = 8, **controls: Any) -> SamplingParams:
    """Greedy decoding of exactly `max_new_tokens` tokens (EOS ignored unless `controls` say otherwise)."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **{"ignore_eos": True, **controls})


GREEDY = greedy()  # 8 greedy tokens, EOS ignored: the engine tests' default request


def peft_logits(model: PeftModel, adapter_id: str | None, ids: list[int]) -> torch.Tensor:
    """PEFT's logits [len(ids), vocab] of `ids` with `adapter_id` active (None: the base model alone)."""
    import torch

    with torch.no_grad():
        if adapter_id is None:
            with model.disable_adapter():
                return model(torch.tensor([ids])).logits[0]
        model.set_adapter(adapter_id)
        return model(torch.tensor([ids])).logits[0]


def capture_logits(engine: Any) -> dict[str, list[torch.Tensor]]:
    """Wrap `engine.runner.forward` so that every sampled row's logits are kept, per request id, in
    step order (the engine works unchanged); returns that record, filled as the engine steps."""
    captured: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def spy(batch: Any) -> torch.Tensor:
        logits = forward(batch)
        for seq, row in zip(batch.sampled, logits, strict=True):
            captured.setdefault(seq.request_id, []).append(row.clone())
        return logits

    engine.runner.forward = spy
    return captured


def run_joining(engine: Any, requests: list[tuple[str, str, str | None]], sampling: SamplingParams,
                first: int, steps_before: int) -> dict[str, Any]:
    """Add the `first` of `requests` (request id, prompt, adapter), step `steps_before` times so that
    they prefill and start decoding, add the rest (they join the running batch), and step until all
    finish; returns each request's final output by id."""
    finals: dict[str, Any] = {}
    for rid, prompt, aid in requests[:first]:
        engine.add_request(rid, prompt, aid, sampling)
    for _ in range(steps_before):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, prompt, aid in requests[first:]:
        engine.add_request(rid, prompt, aid, sampling)
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return finals


def assert_matches_peft(model: PeftModel, adapter_id: str | None, out: Any, rows: list[torch.Tensor],
                        new_tokens: int, tol: float, label: str) -> torch.Tensor:
    """An engine's greedy output `out` (`new_tokens` tokens) against PEFT's `model` on the same ids:
    all its tokens, each token PEFT's argmax, each logprob (if asked) PEFT's within `tol`, and the
    logits it sampled from (`rows`, kept by `capture_logits`) PEFT's within `tol`. `label` names the
    request in the messages. Returns PEFT's logits at those positions [new_tokens, vocab]."""
    import torch

    assert len(out.token_ids) == new_tokens, f"{label} gets all {new_tokens} tokens"
    ref = peft_logits(model, adapter_id, out.prompt_token_ids + out.token_ids)
    ref = ref[out.prompt_tokens - 1 : out.prompt_tokens - 1 + new_tokens].float()
    assert ref.argmax(-1).tolist() == out.token_ids, f"{label}: tokens diverge from PEFT"
    ref_lp = torch.log_softmax(ref, dim=-1)
    for i, lp in enumerate(out.logprobs or ()):
        assert abs(lp.logprob - ref_lp[i, lp.token_id].item()) <= tol, (
            f"{label} token {i}: the logprob is PEFT's within {tol}")
    torch.testing.assert_close(torch.stack(rows).cpu(), ref, atol=tol, rtol=0,
                               msg=lambda m: f"{label}: logits must equal PEFT's within {tol}: {m}")
    return ref


def free_tcp_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adapter_hits(http: Any, adapters: list[str], prompt: str, rounds: int) -> list[str]:
    """Adapter affinity as a client sees it: one completion per adapter (each is placed once), a
    pause for the replicas' reports to reach the router, then `rounds` completions over `adapters`
    in a fixed interleaved order from 4 threads; returns each answer's `x-lora-adapter-hit` and
    `x-lora-replica` headers ("true r1"), in the order sent."""
    def complete(adapter: str) -> str:
        r = http.post("/v1/completions", json={"model": adapter, "prompt": prompt, "max_tokens": 4,
                                               "temperature": 0})
        assert r.status_code == 200, f"{adapter}: the completion succeeds: {r.text}"
        return r.headers["x-lora-adapter-hit"] + " " + r.headers["x-lora-replica"]

    for adapter in adapters:  # warm-up: every adapter is placed once
        complete(adapter)
    time.sleep(1.5)  # let the replicas' reports reach the router
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(complete, adapter_order(adapters, rounds)))


def adapter_order(adapters: list[str], rounds: int) -> list[str]:
    """The order in which `adapter_hits` sends its `rounds` completions."""
    n = len(adapters)
    return [adapters[(i * 5 + i // n) % n] for i in range(rounds)]


def cluster_view(http: Any) -> dict[str, Any]:
    """`GET /v1/cluster` of the app behind the httpx client `http` (asserted 200)."""
    r = http.get("/v1/cluster")
    assert r.status_code == 200, f"/v1/cluster answers: {r.text}"
    return r.json()


def cluster_replicas(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The replicas of a `/v1/cluster` view, by replica id, over all its nodes."""
    return {rid: r for node in view["nodes"].values() for rid, r in node["replicas"].items()}


@contextlib.contextmanager
def serve_run(config: Path, env: dict[str, str], url: str, log: Path, start_s: float = 240) -> Iterator[None]:
    """`serve run config` as a user starts it (its own process group, output to `log`), for the block,
    once `url/health` answers 200; stopped by SIGTERM (`serve run` in the background ignores SIGINT),
    then SIGKILL to the group if it lingers."""
    import httpx

    command = [str(Path(sys.executable).parent / "serve"), "run", str(config)]
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"serve run exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert poll(up, start_s, interval_s=1.0), (
            f"serve run did not answer in {start_s} s: {log.read_text()[-3000:]}")
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


async def _answer_of(response: Any) -> Any:
    return await response


class CoalescedShard:
    """A controller shard handle of the coalesced park API (`admit_many`, `grants`,
    `serve.controller_actor`) over an older fake whose `admit.remote(ticket, timeout_s)` answers one park
    once its outcome is decided: each ticket of a park call goes to it at once; what it answers within
    a few loop turns is the call's reply (an exception fails the call, as a dead controller's would;
    an outcome's `edge` is the reply's), later answers wait for the ingress's grants poll. Every other
    attribute is the fake's."""

    def __init__(self, fake: Any, turns: int = 3):
        self.fake, self.turns = fake, turns
        self.admit_many = types.SimpleNamespace(remote=self._admit_many)
        self.grants = types.SimpleNamespace(remote=self._grants)
        self._mail: dict[str, dict[str, dict]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fake, name)

    def _admit_many(self, ingress_id: str, tickets: list[dict], claims: dict | None) -> Any:
        sent = [(t["ticket_id"], self.fake.admit.remote({**t, "ingress_id": ingress_id, "claims": claims},
                                                        t["ttl_s"])) for t in tickets]
        return self._reply(ingress_id, sent)

    async def _reply(self, ingress_id: str, sent: list[tuple[str, Any]]) -> dict:
        tasks = [(tid, asyncio.ensure_future(_answer_of(r))) for tid, r in sent]
        for _ in range(self.turns):
            await asyncio.sleep(0)
        reply: dict[str, Any] = {"outcomes": {}, "epoch": "e1"}
        for tid, task in tasks:
            if task.done():
                self._file(reply, tid, task.result())  # raises the call's failure
            else:
                task.add_done_callback(functools.partial(self._later, ingress_id, tid))
        reply["outcomes"].update(self._mail.pop(ingress_id, {}))
        return reply

    @staticmethod
    def _file(reply: dict, ticket_id: str, outcome: dict) -> None:
        if "edge" in outcome:
            reply["edge"] = outcome["edge"]
        if "timeout" not in outcome:
            reply["outcomes"][ticket_id] = {k: v for k, v in outcome.items() if k != "edge"}

    def _later(self, ingress_id: str, ticket_id: str, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            reply: dict[str, Any] = {"outcomes": self._mail.setdefault(ingress_id, {})}
            self._file(reply, ticket_id, task.result())

    def _grants(self, ingress_id: str, timeout_s: float, epoch: str | None = None) -> Any:
        async def answer() -> dict:
            deadline = time.monotonic() + min(timeout_s, 5.0)
            while not self._mail.get(ingress_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            return {"outcomes": self._mail.pop(ingress_id, {}), "epoch": "e1"}
        return answer()
