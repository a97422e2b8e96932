"""The cluster tier's policy (`cluster.cluster_tier`): publication once, the cheapest source, byte budget
and eviction, and losing a node."""

from __future__ import annotations

from lora_cluster.cluster.cluster_tier import ClusterTier, FetchFrom


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def published(tier: ClusterTier, adapter_id: str, node_id: str, nbytes: int = 100) -> None:
    assert tier.claim_publication(adapter_id, nbytes), f"{adapter_id} can be published"
    tier.published_by(adapter_id, node_id, nbytes, sha256="ab" * 32)


def test_an_adapter_is_published_once() -> None:
    tier = ClusterTier(1000, clock=Clock())
    published(tier, "a", "n1")
    assert not tier.claim_publication("a", 100), "a second node's source fetch does not publish it again"
    assert tier.bytes == 100, "its bytes count once"


def test_a_miss_copies_from_a_peer_when_that_is_faster_than_the_source() -> None:
    tier = ClusterTier(1000, clock=Clock())
    assert tier.choose("a", "n2", peer_s=0.2, source_s=1.3).kind is FetchFrom.SOURCE, \
        "an adapter nobody published comes from the source"
    published(tier, "a", "n1")
    choice = tier.choose("a", "n2", peer_s=0.2, source_s=1.3)
    assert (choice.kind, choice.node_id) == (FetchFrom.PEER, "n1"), "a published adapter comes from a holder"
    assert tier.choose("a", "n2", peer_s=2.0, source_s=1.3).kind is FetchFrom.SOURCE, \
        "the source wins when a copy would be slower"
    assert tier.choose("a", "n1", peer_s=0.2, source_s=1.3).kind is FetchFrom.SOURCE, \
        "a node is never its own peer"


def test_busy_holders_share_the_copies() -> None:
    tier = ClusterTier(1000, clock=Clock())
    published(tier, "a", "n1")
    tier.copy_started("a", "n1")
    tier.copy_ended("a", "n1", "n2", ok=True)
    tier.copy_started("a", "n1")  # n1 serves a copy right now
    choice = tier.choose("a", "n3", peer_s=0.2, source_s=1.3)
    assert choice.node_id == "n2", "the idle holder is chosen over the busy one"
    tier.copy_ended("a", "n1", "n4", ok=False)
    assert "n4" not in tier.holders("a"), "a copy whose checksum failed adds no holder"


def test_waiting_for_a_fetch_in_flight_elsewhere_when_it_ends_sooner() -> None:
    clock = Clock()
    tier = ClusterTier(1000, clock=clock)
    assert tier.source_fetch_started("a", "n1", expected_s=1.3), "the first source fetch is recorded"
    assert not tier.source_fetch_started("a", "n2", expected_s=1.3), "one source fetch per adapter recorded"
    clock.now = 1.0
    choice = tier.choose("a", "n2", peer_s=0.2, source_s=1.3)
    assert (choice.kind, choice.node_id) == (FetchFrom.WAIT, "n1"), "0.3 s left plus a copy beats 1.3 s"
    assert abs(choice.seconds - 0.5) < 1e-9, "the estimate is the time left plus one copy"
    tier.source_fetch_ended("a", "n1")
    assert "a" not in tier.in_flight, "an ended fetch is forgotten"


def test_the_byte_budget_evicts_least_recently_used_but_never_a_copy_in_progress() -> None:
    tier = ClusterTier(300, clock=Clock())
    for name in ("a", "b", "c"):
        published(tier, name, "n1")
    tier.copy_started("a", "n1")  # a is being copied: not a victim, and now the most recent
    published(tier, "d", "n1")
    assert "b" not in tier and "a" in tier, "the least recently used idle adapter goes first"
    assert tier.bytes <= tier.budget, "the tier stays within its budget"
    tier.copy_started("c", "n1")
    tier.copy_started("d", "n1")
    assert not tier.claim_publication("e", 100), "nothing is evicted while every entry is being copied"
    assert not tier.claim_publication("f", 301), "an adapter larger than the budget is never published"


def test_losing_a_node_loses_no_adapter() -> None:
    tier = ClusterTier(1000, clock=Clock())
    published(tier, "a", "n1")
    tier.copy_started("a", "n1")
    tier.copy_ended("a", "n1", "n2", ok=True)
    published(tier, "b", "n1")
    tier.source_fetch_started("c", "n1", expected_s=1.0)
    gone = tier.node_lost("n1")
    assert gone == ["b"], "only the adapter whose every copy was on the lost node is unpublished"
    assert tier.holders("a") == {"n2"}, "the other copy still serves"
    assert tier.choose("b", "n2", peer_s=0.2, source_s=1.3).kind is FetchFrom.SOURCE, \
        "an adapter without copies falls back to its source"
    assert "c" not in tier.in_flight, "a source fetch on the lost node is not waited for"
    assert tier.claim_publication("b", 100), "it can be published again"
