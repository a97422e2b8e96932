"""Version references (`name@N`) and the canary split: sticky per user, growing with the share."""

from __future__ import annotations

from lora_cluster.releases.refs import parse_ref
from lora_cluster.releases.split import BUCKETS, Alias, bucket, takes_candidate


def test_a_reference_names_a_version_or_the_alias():
    assert parse_ref("fin@2") == ("fin", 2), "name@N addresses version N"
    assert parse_ref("fin") == ("fin", None), "a bare name is the alias"
    assert parse_ref("org/fin@12") == ("org/fin", 12), "a name with folders keeps them"
    assert parse_ref("fin@0") == ("fin@0", None), "versions start at 1: @0 stays in the name"
    assert parse_ref("fin@x") == ("fin@x", None), "a non-number after @ stays in the name"


def test_the_split_is_sticky_per_user_and_grows_with_the_share():
    users = [f"user-{i}" for i in range(2000)]
    at_5 = {u for u in users if Alias(1, 2, 5.0, "r1").resolve(u) == 2}
    at_25 = {u for u in users if Alias(1, 2, 25.0, "r1").resolve(u) == 2}
    assert at_5 <= at_25, "a user on the candidate at 5% stays on it at 25%"
    assert 40 <= len(at_5) <= 170, f"about 5% of users get the candidate, got {len(at_5)}"
    assert 400 <= len(at_25) <= 600, f"about 25% of users get the candidate, got {len(at_25)}"
    assert all(Alias(1, 2, 5.0, "r1").resolve(u) == (2 if u in at_5 else 1) for u in users[:50]), \
        "the same user resolves the same way every time"


def test_the_split_edges():
    assert Alias(3).resolve("anyone") == 3, "without a candidate the alias is the stable version"
    assert Alias(1, 2, 100.0, "r").resolve("anyone") == 2, "at 100% every user gets the candidate"
    assert Alias(1, 2, 0.0, "r").resolve("anyone") == 1, "at 0% no user does"
    assert takes_candidate(1.0, 99) and not takes_candidate(1.0, 100), "1% is buckets 0..99"
    assert bucket("r1", "u") != bucket("r2", "u") or bucket("r1", "v") != bucket("r2", "v"), \
        "releases bucket users independently"
    assert 0 <= bucket("r", "u") < BUCKETS, "a bucket is in range"
