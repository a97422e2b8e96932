"""An ingress's claims sent with what changed since its previous park call to the shard
(`park_batch.ClaimHints`): the shard that takes the hint touches those replicas only, and decides
exactly as the one that compares the mappings, through lost calls, restarts and expired claims."""

from __future__ import annotations

import random

from helpers import FakeClock
from test_cluster_view_indexes import random_report

from lora_cluster.cluster.cluster_view import ClusterView
from lora_cluster.cluster.park_batch import ClaimHints


def _hint(claims: dict[str, object]) -> tuple[int, int, list[str]]:
    changed = claims["changed"]
    assert isinstance(changed, list)
    return int(str(claims["seq"])), int(str(claims["base"])), changed


def test_a_stamp_numbers_each_shards_calls_and_names_what_changed_since_its_last() -> None:
    hints = ClaimHints(2)
    first = hints.stamp(0, {"inflight": {}, "unassigned": 0})
    assert (first["seq"], first["base"], first["changed"]) == (1, 0, []), "the first call: no change yet"
    hints.changed("r2")
    hints.changed("r1")
    hints.changed("r2")
    second = hints.stamp(0, {"inflight": {"r1": 1}, "unassigned": 3})
    assert (second["seq"], second["base"], second["changed"]) == (2, 1, ["r1", "r2"]), (
        "the next call to that shard: its number, the previous one's, and each changed replica once, sorted")
    assert (second["inflight"], second["unassigned"]) == ({"r1": 1}, 3), "the claims themselves as given"
    assert hints.stamp(0, {})["changed"] == [], "stamped: the changes are that call's, not the next's"
    other = hints.stamp(1, {})
    assert (other["seq"], other["base"], other["changed"]) == (1, 0, ["r1", "r2"]), (
        "another shard keeps its own numbers and its own changes since its own last call")


def test_a_shard_that_takes_the_hint_sees_the_room_of_one_that_compares_the_claims() -> None:
    """Two views, one given the hints and one not, through random reports, grants, arrivals, claims
    (counts that change and change back), lost park calls (a stamp never delivered), restarted
    views and expired claims: the same room everywhere after every step, as `free` says."""
    rng = random.Random(7)
    clock = FakeClock(100.0)

    def fresh() -> ClusterView:
        return ClusterView(stale_after_s=5.0, clock=clock, claim_ttl_s=1.0, claim_superseded_after_s=0.1)

    hinted, compared = fresh(), fresh()
    ids = [f"r{i:02d}" for i in range(24)]
    counts: dict[str, dict[str, int]] = {"i1": {}, "i2": {}}
    hints = {"i1": ClaimHints(1), "i2": ClaimHints(1)}
    used = lost = 0
    for step in range(3000):
        clock.now += rng.choice((0.0, 0.01, 0.05, 0.2, 0.6))
        action = rng.random()
        rid = rng.choice(ids)
        if action < 0.3:
            report = random_report(rng, rid)
            hinted.update(report)
            compared.update(report)
        elif action < 0.45:  # the ingress's counts change (sometimes back to what the view holds)
            ingress = rng.choice(("i1", "i2"))
            counts[ingress] = {**counts[ingress], rid: rng.randrange(4)}
            hints[ingress].changed(rid)
        elif action < 0.75:  # a park call: its claims, stamped; now and then lost on its way
            ingress = rng.choice(("i1", "i2"))
            inflight = counts[ingress]  # kept as sent: a change makes a new mapping
            claims = hints[ingress].stamp(0, {"inflight": inflight, "unassigned": 0})
            if rng.random() < 0.05:
                lost += 1
                continue
            used += 1
            hinted.claim(ingress, inflight, 0, _hint(claims))
            compared.claim(ingress, inflight, 0)
        elif action < 0.85 and len(compared):
            target, ticket = rng.choice(sorted(compared.ids())), f"t{step}"
            hinted.granted(target, ticket)
            compared.granted(target, ticket)
        elif action < 0.97:
            arrived = [f"t{step - k}" for k in range(1, 30)]
            hinted.arrived(rid, arrived)
            compared.arrived(rid, arrived)
        elif action < 0.99:
            hinted.forget(rid)
            compared.forget(rid)
        else:  # a restarted shard: it holds no claims, so the next one is compared whole
            hinted, compared = fresh(), fresh()
        want = {r for r in compared.ids() if compared.free(r) > 0}
        assert compared.free_ids() == want, f"step {step}: the comparing view, as free() says"
        assert hinted.free_ids() == want, f"step {step}: the hinted view has room where the other has"
        assert hinted.total_free() == compared.total_free() == sum(compared.free(r) for r in want), (
            f"step {step}: the same room summed")
        assert hinted.free_ids() == compared.free_ids(), f"step {step}: the same replicas with room"
    assert used > 500 and lost > 20, "many hinted claims, and some lost calls"
