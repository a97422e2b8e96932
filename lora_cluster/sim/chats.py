"""Multi-turn chats: the workload that prefix caching and prefix-aware routing are for.

`sessions` users chat at once. Each user runs one chat after another; a chat is pinned to an adapter
drawn Zipf (`popularity`, over the workload's adapters), has an SLA class drawn from the mix, and
lasts up to `turns` turns:

* turn 1's prompt is the adapter's system prompt (`system_tokens` tokens, one per adapter: every
  chat of an adapter starts with it) followed by the user's first message;
* turn k + 1's prompt is turn k's prompt, turn k's answer and the user's next message (the earlier
  turns are resent, as every chat API does);
* a turn arrives `think` seconds (exponential, mean `think_s`) after the previous turn's answer
  ended; a user's first chat starts at a uniform time within one mean think time (a ramp), and the
  next chat `think` seconds after the previous one ended. A chat whose turn was refused ends there,
  and so does one whose next prompt and answer would pass `MAX_CHAT_TOKENS`.

Messages are log-normal (median `user_median` tokens, sigma 0.8, within [4, 512]); answers follow
the workload's output lengths (`workload.OUTPUT_MEDIAN`). Token ids are drawn, so a request carries
real ones, and with them what the live system computes from them:

* `SimRequest.prefix`: its prompt's routing keys (`cluster.prefix_keys.routing_keys`, as
  `GenerateJob.routing_prefix`), which the router and the cluster queue read;
* `SimRequest.blocks`: the engine's content keys (`replica_policy.prefix_hash`: chain root of the adapter at
  version 0, one key per full block of `block_size` tokens) of its prompt and answer, which the
  replica's prefix cache model (`sim.prefix_cache`) looks up and keeps.

Turns arrive only before `end`; a user whose next turn would come later stops. Everything is drawn
from `random.Random(seed + 3)` (and the system prompts from the adapter's name and the seed), so a
seed gives the same chats for the same answers' timing.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from lora_cluster.cluster.prefix_keys import routing_keys
from lora_cluster.cluster.sla import SlaClass
from lora_cluster.replica_policy.prefix_hash import chain_root, extend_keys
from lora_cluster.sim.events import EventLoop
from lora_cluster.sim.popularity import ZipfSampler
from lora_cluster.sim.workload import LENGTH_SIGMA, OUTPUT_MEDIAN, OUTPUT_RANGE, SimRequest, Workload

VOCAB = 32_000  # token ids are drawn from [0, VOCAB)
MESSAGE_RANGE = (4, 512)
MAX_CHAT_TOKENS = 8192  # a chat ends before its prompt and answer pass this (a model's context)


@dataclass(frozen=True)
class ChatSettings:
    """The chat workload's shape (see the module docstring)."""

    sessions: int  # users chatting at once
    turns: int = 8  # turns per chat at most
    think_s: float = 10.0  # mean seconds between an answer and the user's next message
    system_tokens: int = 1000  # tokens of each adapter's system prompt
    user_median: float = 50.0  # median tokens of a user's message

    def __post_init__(self) -> None:
        if (self.sessions < 1 or self.turns < 1 or self.think_s < 0 or self.system_tokens < 0
                or self.user_median < 1):
            raise ValueError("chats need sessions >= 1, turns >= 1, think_s >= 0, system_tokens >= 0 "
                             "and user_median >= 1")


class _Chat:
    __slots__ = ("adapter", "keys", "root", "session", "sla", "tokens", "turn")

    def __init__(self, session: int, adapter: str, sla: SlaClass, tokens: list[int], keys: list[bytes],
                 root: bytes):
        self.session, self.adapter, self.sla = session, adapter, sla
        self.tokens, self.keys, self.root = tokens, keys, root
        self.turn = 0


class ChatWorkload:
    """The users and their chats; `start` schedules the first turns, `ended` hears of each turn's end."""

    def __init__(self, settings: ChatSettings, workload: Workload, classes: list[tuple[SlaClass, float]], *,
                 zipf: float, seed: int, block_size: int, loop: EventLoop, end: float,
                 submit: Callable[[SimRequest], None]):
        self.settings, self.workload, self.block_size = settings, workload, block_size
        self._popularity = ZipfSampler(len(workload.names), zipf)
        self.loop, self.end, self.submit = loop, end, submit
        self.rng = random.Random(seed + 3)
        self._seed = seed
        self._classes = [c for c, _ in classes]
        self._cum_classes = list(itertools.accumulate(w for _, w in classes))
        self._ids = itertools.count()
        self._system: dict[str, tuple[list[int], list[bytes], bytes]] = {}  # bounded by the adapters
        self._open: dict[int, _Chat] = {}  # request id -> its chat (one open request per user at most)
        self.chats_started = self.turns_sent = 0

    def start(self) -> None:
        for session in range(self.settings.sessions):
            self.loop.at(self.rng.uniform(0.0, self.settings.think_s), self._begin, session)

    def _think(self) -> float:
        return self.rng.expovariate(1.0 / self.settings.think_s) if self.settings.think_s > 0 else 0.0

    def _message(self, median: float, bounds: tuple[int, int]) -> int:
        return min(bounds[1], max(bounds[0], round(self.rng.lognormvariate(math.log(median), LENGTH_SIGMA))))

    def _system_prompt(self, adapter: str) -> tuple[list[int], list[bytes], bytes]:
        """The adapter's system prompt: its token ids, the engine's keys of its full blocks, the root."""
        if adapter not in self._system:
            rng = random.Random(f"{self._seed}:{adapter}")
            tokens = [rng.randrange(VOCAB) for _ in range(self.settings.system_tokens)]
            root = chain_root(adapter, 0)
            keys: list[bytes] = []
            extend_keys(keys, root, tokens.__getitem__, len(tokens), self.block_size)
            self._system[adapter] = (tokens, keys, root)
        return self._system[adapter]

    def _begin(self, session: int) -> None:
        if self.loop.now >= self.end:
            return
        adapter = self.workload.names[self._popularity.draw(self.rng)]
        c = bisect.bisect(self._cum_classes, self.rng.random() * self._cum_classes[-1])
        tokens, keys, root = self._system_prompt(adapter)
        sla = self._classes[min(c, len(self._classes) - 1)]
        chat = _Chat(session, adapter, sla, list(tokens), list(keys), root)
        self.chats_started += 1
        self._turn(chat)

    def _turn(self, chat: _Chat) -> None:
        """The user's next message arrives: the chat's next request."""
        now = self.loop.now
        user = self._message(self.settings.user_median, MESSAGE_RANGE)
        answer = self._message(OUTPUT_MEDIAN, OUTPUT_RANGE)
        if len(chat.tokens) + user + answer > MAX_CHAT_TOKENS:
            self.loop.after(self._think(), self._begin, chat.session)
            return
        rng = self.rng
        chat.tokens.extend(rng.randrange(VOCAB) for _ in range(user + answer))
        prompt = len(chat.tokens) - answer
        # the keys of every block the request computes: its prompt and its answer but the last token
        extend_keys(chat.keys, chat.root, chat.tokens.__getitem__, prompt + answer - 1, self.block_size)
        chat.turn += 1
        rid = next(self._ids)
        req = SimRequest(rid, chat.adapter, chat.sla, prompt, answer, now, now >= self.workload.measure_from)
        req.prefix = routing_keys(chat.adapter, chat.tokens[:prompt])
        req.blocks = tuple(chat.keys)
        self._open[rid] = chat
        self.turns_sent += 1
        self.submit(req)

    def ended(self, req: SimRequest, completed: bool) -> None:
        """The request ended (answered, or refused): the user thinks, then sends the chat's next
        message or, after the last turn or a refusal, starts a new chat."""
        chat = self._open.pop(req.rid)
        nxt = self._turn if completed and chat.turn < self.settings.turns else None
        when = self.loop.now + self._think()
        if when >= self.end:
            return
        if nxt is not None:
            self.loop.at(when, nxt, chat)
        else:
            self.loop.at(when, self._begin, chat.session)
