"""Shadow traffic of a release: copies of the stable version's live requests run on the candidate,
compared with the live answers, and never returned to a client.

Which requests: an OpenAI (completions, chat) or LoRAX (`/generate`, `/generate_stream`, `/`)
request of one job (one prompt, one choice), greedy (temperature 0, so that the two versions' tokens
can be compared), streamed or not, whose job runs the stable version of a release in its canary (or
paused) with a `shadow_percent` above 0; each such request is copied with that probability, drawn
when its job starts. When: after its live answer is complete (a streamed one: after its last event,
and only when the stream ended normally; a client that went away or an error ends it uncopied), as a
task of its own, so a copy never delays the request it copies. How: non-streamed, at the least
urgent SLA class (the engine schedules it last and the cluster sheds it first); a copy that fails, is
shed or refused is dropped, never retried, and is no evidence (it says nothing of the candidate's
answers). Compared with: the tokens the client was sent (a streamed answer's, item by item; a whole
answer's final tokens), and beyond tokens (`ShadowCheck`): under a request's JSON constraint
(`response_format` json_schema or json_object, `guided_json`), whether each answer's text is a JSON
document valid for it; where the live answer carries its tokens' logprobs (the client asked for
them; the copy runs with the same sampling, so it carries its own), their absolute differences over
the prefix both versions generated alike. A live answer without logprobs gives no divergence: the
copy could ask for its own, but there would be nothing on the stable side to compare them with.
Bounded: at most `MAX_IN_FLIGHT` copies per ingress at once (one `ShadowCopies` serves every
route); past that, answers are not copied. The comparison (`ShadowStats`: token agreement, schema
validity, logprob divergence, TTFT) is the release's evidence (`ReleaseBook.record_shadow`), with
its own gates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
from collections.abc import Callable
from typing import Any

from lora_cluster.releases.gates import ShadowCheck
from lora_cluster.releases.refs import parse_ref
from lora_cluster.releases.release import ReleaseState
from lora_cluster.request.guided_spec import GuidedKind, GuidedSpec
from lora_cluster.serve.http.adapter_versions import replica_id_of
from lora_cluster.serve.http.context import ApiContext
from lora_cluster.serve.http.release_eval import schema_valid
from lora_cluster.serve.protocol import GenerateJob

log = logging.getLogger(__name__)
MAX_IN_FLIGHT = 8
ROUTE = "/v1/adapters/releases/shadow"


@dataclasses.dataclass(frozen=True)
class ShadowCopy:
    """A copy decided for one live job: the candidate's job, the adapter name and the release."""

    job: GenerateJob
    name: str
    release_id: str


@dataclasses.dataclass
class Answer:
    """One version's answer as compared: its tokens, TTFT, text and its tokens' logprobs (None: not
    asked for)."""

    tokens: list[int]
    ttft_s: float = 0.0
    text: str = ""
    logprobs: list[float] | None = None

    @classmethod
    def of(cls, final: dict[str, Any]) -> Answer:
        """The answer of a generation's final item."""
        entries = final.get("logprobs")
        return cls(list(final.get("token_ids") or []), float(final.get("ttft_s") or 0.0),
                   final.get("text") or "", None if entries is None else [logprob(e) for e in entries])


def logprob(entry: Any) -> float:
    """The logprob of a chosen token's entry (a `TokenLogprob`, or its dict form)."""
    return float(entry["logprob"] if isinstance(entry, dict) else entry.logprob)


def json_valid(guided: GuidedSpec | None, text: str) -> bool | None:
    """Whether `text` is a JSON document valid under a JSON constraint (None: not a JSON one)."""
    if guided is None or guided.kind not in (GuidedKind.JSON_SCHEMA, GuidedKind.JSON_OBJECT):
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return False
    if guided.kind is GuidedKind.JSON_OBJECT:
        return isinstance(document, dict)
    return schema_valid(json.loads(guided.text), document)


def check(job: GenerateJob, stable: Answer, candidate: Answer) -> ShadowCheck:
    """What a copy tells beyond tokens (module docstring)."""
    gaps: list[float] = []
    if stable.logprobs is not None and candidate.logprobs is not None:
        for ours, theirs, lp_ours, lp_theirs in zip(stable.tokens, candidate.tokens, stable.logprobs,
                                                    candidate.logprobs, strict=False):
            if ours != theirs:
                break
            gaps.append(abs(lp_ours - lp_theirs))
    guided = job.sampling.guided
    return ShadowCheck(json_valid(guided, stable.text), json_valid(guided, candidate.text), tuple(gaps))


class ShadowCopies:
    """The shadow copies of one ingress (module docstring); `rng`: a uniform draw in [0, 1)."""

    def __init__(self, ctx: ApiContext, rng: Callable[[], float] = random.random):
        self.ctx, self._rng = ctx, rng
        classes = ctx.policy.sla.by_name.values()
        self.batch = max(classes, key=lambda c: c.priority)  # the least urgent class
        self._tasks: set[asyncio.Task[None]] = set()
        self.copied = 0  # copies started since the ingress started

    def in_flight(self) -> int:
        """Copies running now (at most MAX_IN_FLIGHT)."""
        return len(self._tasks)

    def maybe_copy(self, jobs: list[GenerateJob], finals: list[dict[str, Any]]) -> bool:
        """After a whole live answer: copy it to the candidate when the release and the draw say so."""
        copy = self.decide(jobs)
        if copy is None:
            return False
        return self.start(copy, Answer.of(finals[0]))

    def tap(self, jobs: list[GenerateJob]) -> StreamTap | None:
        """Before a live stream: what collects the tokens it sends and copies it once it ended (None:
        this stream is not copied)."""
        copy = self.decide(jobs)
        return None if copy is None else StreamTap(copy, self.start)

    def decide(self, jobs: list[GenerateJob]) -> ShadowCopy | None:
        """The copy of a request of `jobs`, when it is one to copy and the draw says so."""
        if len(jobs) != 1:
            return None
        job = jobs[0]
        if job.adapter_id is None or job.merge is not None or job.sampling.temperature != 0:
            return None
        name, number = parse_ref(job.adapter_id)
        running = self.ctx.releases.running(name)
        if running is None or running.state not in (ReleaseState.CANARY, ReleaseState.PAUSED):
            return None
        percent = running.settings.shadow_percent
        if (number or 1) != running.stable or percent <= 0 or self._rng() * 100 >= percent:
            return None
        candidate = replica_id_of(name, running.candidate)
        copy = dataclasses.replace(job, request_id=self.ctx.new_id("shadow"), adapter_id=candidate,
                                   adapter_path=self.ctx.models.adapter_path(candidate), stream=False,
                                   priority_class=self.batch.name, priority=self.batch.priority,
                                   replica_id=None, ticket_id=None, queued_s=0.0)
        return ShadowCopy(copy, name, running.id)

    def start(self, copy: ShadowCopy, live: Answer) -> bool:
        """Run `copy` as a task of its own, compared with the live answer; False (dropped) when
        MAX_IN_FLIGHT copies run already."""
        if len(self._tasks) >= MAX_IN_FLIGHT:
            return False
        task = asyncio.get_running_loop().create_task(self._run(copy, live))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.copied += 1
        return True

    async def _run(self, copy: ShadowCopy, live: Answer) -> None:
        try:
            generation = await self.ctx.dispatcher.start(copy.job, ROUTE)
        except Exception as exc:  # shed, refused, no replica: dropped, no evidence
            log.debug("shadow copy of %s not started: %s", copy.name, type(exc).__name__)
            return
        try:
            final = await generation.final()
        except Exception as exc:
            log.debug("shadow copy of %s failed: %s", copy.name, type(exc).__name__)
            return
        except BaseException:
            generation.cancel()
            raise
        answer = Answer.of(final)
        self.ctx.release_state.book.record_shadow(copy.name, copy.release_id, live.tokens, answer.tokens,
                                                  live.ttft_s, answer.ttft_s, check(copy.job, live, answer))

    def stop(self) -> None:
        """Cancel the copies in flight (the ingress goes away)."""
        for task in list(self._tasks):
            task.cancel()


class StreamTap:
    """The answer one live stream sent its client, item by item (at most its max_tokens tokens): its
    tokens, text, logprobs and TTFT; `end()` after its last event starts its copy when the stream
    finished."""

    def __init__(self, copy: ShadowCopy, start: Callable[[ShadowCopy, Answer], bool]):
        self._copy, self._start = copy, start
        self.answer = Answer([], logprobs=[])
        self.finished = False

    def add(self, item: dict[str, Any]) -> None:
        """One output item the client was sent."""
        answer, delta = self.answer, list(item.get("delta_token_ids") or ())
        answer.tokens.extend(delta)
        answer.text += item.get("delta_text") or ""
        entries = item.get("delta_logprobs")
        if delta and answer.logprobs is not None:
            answer.logprobs = None if entries is None else answer.logprobs + [logprob(e) for e in entries]
        if item.get("ttft_s") is not None:
            answer.ttft_s = float(item["ttft_s"])
        self.finished = self.finished or bool(item.get("finished"))

    def end(self) -> bool:
        """The stream ended normally: start the copy (False: not finished, or over the bound)."""
        return self.finished and self._start(self._copy, self.answer)
