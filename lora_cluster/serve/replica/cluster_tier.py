"""The cluster tier's Ray edge: the index actor's body (`ClusterTierIndex`: the tier's policy,
`cluster.cluster_tier`, and the refs of the published adapters) and `RayClusterTier`, each node's
`store.ports.ClusterTierPort` over it. The actors and their lifetime: `tier_actors`.

An adapter one node fetched from its source is put once into Ray's object store, in the node's stored
form (`store.ports.ClusterTierPort`): the files the disk tier keeps (encrypted at rest when the source
holds them encrypted; never decrypted weights), or with `host_int8` the int8 host copy
(`store.int8_form`, encrypted when the weights were), with each file's sha256; the tier's budget counts
those bytes. A node asks only for its own form (a publication in another form is a miss). Another node's
miss asks the actor where it is and pulls the object node to node (Ray's object manager); every file's
sha256 is checked against the publisher's before a byte reaches the disk cache. The object is owned by
the node's holder actor (`tier_actors.NodeHolder`), so it outlives the replica that published it; when
that node (or the holder) is lost, a pull fails, the actor withdraws what that holder owned
(`ClusterTier.withdraw`) and the node fetches from the source, which publishes the adapter again. Losing
a node loses no adapter.

The actor is called once per cold load of a node (locate; after a source fetch, claim and publish on
the node's publishing thread, off the load), never per request, and never by the cluster controller.
Its byte budget bounds the published bytes; an evicted adapter's ref is dropped, so Ray frees the
object.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, OwnerDiedError, RayActorError, RayError

from lora_cluster.cluster.cluster_tier import ClusterTier, FetchFrom
from lora_cluster.cluster.reports import MAX_REPORTED_CLUSTER
from lora_cluster.store.checksum import sha256_bytes

log = logging.getLogger(__name__)
ACTOR_NAME = "lora_cluster_tier"


def stored_form_sha256(digests: dict[str, str]) -> str:
    """One checksum of an adapter's stored form: the sha256 of its files' sha256, sorted by name."""
    return hashlib.sha256("".join(f"{n}:{d}\n" for n, d in sorted(digests.items())).encode()).hexdigest()


class ClusterTierIndex:
    """The actor's body (`ray.remote` is applied by `cluster_tier_actor`): the policy plus the refs."""

    def __init__(self, budget_bytes: int):
        self.tier = ClusterTier(budget_bytes, clock=time.monotonic)
        # published adapter -> (its object's ref, file digests, the node of the process that owns it, form)
        self.objects: dict[str, tuple[ray.ObjectRef, dict[str, str], str, str]] = {}

    def claim(self, adapter_id: str, nbytes: int) -> bool:
        """Whether the caller should put `adapter_id` (once; evictions for it are made now)."""
        claimed = self.tier.claim_publication(adapter_id, nbytes)
        self._drop_unpublished()
        return claimed

    def publish(self, adapter_id: str, node_id: str, boxed: list[ray.ObjectRef], nbytes: int,
                digests: dict[str, str], form: str = "files") -> None:
        """`node_id` put the stored form `form` of `adapter_id` (the ref in a list, so it is not resolved)."""
        if adapter_id in self.objects:
            return
        self.tier.published_by(adapter_id, node_id, nbytes, stored_form_sha256(digests))
        self.objects[adapter_id] = (boxed[0], dict(digests), node_id, form)

    def locate(self, adapter_id: str, node_id: str,
               form: str = "files") -> tuple[str, list[ray.ObjectRef], dict[str, str]] | None:
        """Where `node_id` copies `adapter_id` from: (the owner's node, [ref], file digests), or None
        (not published, or not in `form`). Ray pulls from whichever node holds a copy; the owner's node
        names the object's fate."""
        found = self.objects.get(adapter_id)
        if found is None or found[3] != form:
            return None
        choice = self.tier.choose(adapter_id, node_id, peer_s=1.0, source_s=math.inf)
        if choice.kind is not FetchFrom.PEER:  # the node itself published it (its disk copy went)
            return None
        self.tier.copy_started(adapter_id, found[2])
        return found[2], [found[0]], found[1]

    def copy_ended(self, adapter_id: str, holder: str, node_id: str, ok: bool) -> None:
        self.tier.copy_ended(adapter_id, holder, node_id, ok=ok)

    def holder_lost(self, node_id: str) -> list[str]:
        """A pull of an object owned on `node_id` failed for good (its node or process is gone): every
        object owned there is gone, whatever copies other nodes pulled (Ray's ownership), so each of
        those adapters is withdrawn; returns them (their next fetch goes to the source)."""
        gone = sorted(a for a, (_, _, owner, _) in self.objects.items() if owner == node_id)
        for adapter_id in gone:
            self.tier.withdraw(adapter_id)
        self.tier.node_lost(node_id)
        self._drop_unpublished()
        return gone

    def transfers(self) -> dict[str, int]:
        """Holder node -> copies it serves now (begun by `locate`, not yet ended; a query for
        operators and tests)."""
        return dict(self.tier.serving)

    def published(self) -> dict[str, list[str]]:
        """Published adapter -> its holders (a query for operators and tests)."""
        return {a: sorted(self.tier.holders(a)) for a in self.tier.published}

    def _drop_unpublished(self) -> None:
        for adapter_id in [a for a in self.objects if a not in self.tier]:
            del self.objects[adapter_id]


class RayClusterTier:
    """A node's `ClusterTierPort` over the tier's index and the node's holder (`tier_actors`; blocking
    calls: a loader thread's). Each actor is found (or created) by its `connect` on first use, so a
    store that never downloads never reaches them; when one died, the next call connects again.

    `local_adapters()` names what this node's copy of the tier holds as far as this replica saw it: the
    adapters it published or copied here, the latest `MAX_REPORTED_CLUSTER`, latest last (its reports'
    `cluster_held`). It does not see the index evict a publication, nor another replica's copies, so it
    may name an adapter whose object is gone: a miss sent here then fetches from a peer or the source,
    as it would anywhere."""

    def __init__(self, connect: Callable[[], Any], connect_holder: Callable[[], Any], node_id: str, *,
                 timeout_s: float = 60.0, max_pending: int = 4):
        self._connect, self._connect_holder = connect, connect_holder
        self.node_id, self.timeout_s = node_id, timeout_s
        self._actor: Any = None
        self._holder: Any = None
        self._lock = threading.Lock()
        self.max_pending, self._pending = max_pending, 0  # publications read and not yet put
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="cluster-tier-publish")
        self._counts = dict.fromkeys(("cluster_tier_fetches", "cluster_tier_refused",
                                      "cluster_tier_publications", "cluster_tier_publications_skipped"), 0)
        self._local: OrderedDict[str, None] = OrderedDict()  # published or copied here, latest last

    def local_adapters(self) -> tuple[str, ...]:
        """The adapters published or copied on this node by this replica, latest last (bounded)."""
        with self._lock:
            return tuple(self._local)

    def _held_here(self, adapter_id: str) -> None:
        with self._lock:
            self._local[adapter_id] = None
            self._local.move_to_end(adapter_id)
            while len(self._local) > MAX_REPORTED_CLUSTER:
                self._local.popitem(last=False)

    def counters(self) -> dict[str, int]:
        """Copies received and refused, publications made and skipped (the fields of
        `serve.ops.metrics.COLD_START_COUNTERS`)."""
        with self._lock:
            return dict(self._counts)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    @property
    def actor(self) -> Any:
        """The tier's index actor."""
        with self._lock:
            if self._actor is None:
                self._actor = self._connect()
            return self._actor

    @property
    def holder(self) -> Any:
        """This node's holder actor (it puts and owns what this node publishes)."""
        with self._lock:
            if self._holder is None:
                self._holder = self._connect_holder()
            return self._holder

    def _lost_actor(self, error: RayError) -> None:
        if isinstance(error, RayActorError):
            with self._lock:
                self._actor = self._holder = None

    def fetch_into(self, adapter_id: str, dest: Path, form: str) -> dict[str, str] | None:
        try:
            found = ray.get(self.actor.locate.remote(adapter_id, self.node_id, form), timeout=self.timeout_s)
        except (RayError, ValueError) as e:  # ValueError: no such named actor
            log.warning("cluster tier unreachable for %r: %s", adapter_id, e)
            if isinstance(e, RayError):
                self._lost_actor(e)
            return None
        if found is None:
            return None
        holder, boxed, digests = found
        ok = False
        try:
            files: dict[str, bytes] = ray.get(boxed[0], timeout=self.timeout_s)
            bad = sorted(n for n in digests if n not in files or sha256_bytes(files[n]) != digests[n])
            if bad or set(files) != set(digests):
                log.warning("cluster tier copy of %r from %s failed its checksum (%s)", adapter_id, holder,
                            ", ".join(bad) or "file list")
                self._count("cluster_tier_refused")
                return None
            for name, data in files.items():
                (dest / name).write_bytes(data)
            ok = True
            self._count("cluster_tier_fetches")
            self._held_here(adapter_id)
            return dict(digests)
        except (OwnerDiedError, ObjectLostError, GetTimeoutError) as e:
            log.info("cluster tier copy of %r from %s lost (%s); fetching from the source", adapter_id,
                     holder, type(e).__name__)
            self.actor.holder_lost.remote(holder)
            return None
        except RayError as e:
            log.warning("cluster tier copy of %r from %s failed: %s", adapter_id, holder, e)
            return None
        finally:
            self.actor.copy_ended.remote(adapter_id, holder, self.node_id, ok)

    def publish(self, adapter_id: str, files: dict[str, bytes], form: str) -> None:
        """Publish `files` on this node's one publishing thread, off the load: a live load never waits
        for the checksums, the claim or the put. At most `max_pending` publications wait; past that one
        is skipped (the next node that downloads the adapter publishes it)."""
        with self._lock:
            if self._pending >= self.max_pending:
                self._counts["cluster_tier_publications_skipped"] += 1
                return
            self._pending += 1
        self._publisher.submit(self._publish, adapter_id, files, form)

    def _publish(self, adapter_id: str, files: dict[str, bytes], form: str) -> None:
        nbytes = sum(map(len, files.values()))
        try:
            if ray.get(self.actor.claim.remote(adapter_id, nbytes), timeout=self.timeout_s):
                digests = {name: sha256_bytes(data) for name, data in files.items()}
                ray.get(self.holder.put.remote(self.actor, adapter_id, files, nbytes, digests, form),
                        timeout=self.timeout_s)
                self._count("cluster_tier_publications")
                self._held_here(adapter_id)
        except (RayError, ValueError) as e:
            log.warning("cannot publish %r to the cluster tier: %s", adapter_id, e)
            if isinstance(e, RayError):
                self._lost_actor(e)
        finally:
            self._published()

    def _published(self) -> None:
        with self._lock:
            self._pending -= 1
