"""Adapter versions and the bare name's alias: every registration is an immutable version, `name@N`
addresses one, old versions are retired within a bound (never one a release uses), and the canary
split is sticky per user."""

from __future__ import annotations

import pytest
from helpers import FakeClock

from lora_cluster.errors import AdapterVersionNotFoundError, RequestError
from lora_cluster.releases.catalog import VersionCatalog, parse_ref
from lora_cluster.releases.split import BUCKETS, Alias, bucket, takes_candidate


def test_a_reference_names_a_version_or_the_alias():
    assert parse_ref("fin@2") == ("fin", 2), "name@N addresses version N"
    assert parse_ref("fin") == ("fin", None), "a bare name is the alias"
    assert parse_ref("org/fin@12") == ("org/fin", 12), "a name with folders keeps them"
    assert parse_ref("fin@0") == ("fin@0", None), "versions start at 1: @0 stays in the name"
    assert parse_ref("fin@x") == ("fin@x", None), "a non-number after @ stays in the name"


def test_every_registration_creates_the_next_immutable_version():
    clock = FakeClock(1_700_000_000.0)
    catalog = VersionCatalog(clock)
    first, _ = catalog.register("fin", "/zoo/fin-a", "h1")
    clock.advance(60)
    second, _ = catalog.register("fin", "/zoo/fin-b", "h2")
    assert (first.number, second.number) == (1, 2), "numbers count the registrations of a name"
    assert second.ref == "fin@2", "a version's reference is name@N"
    assert catalog.get("fin", 1).source == "/zoo/fin-a", "version 1 keeps its source"
    assert catalog.get("fin", 2).created_at == 1_700_000_060.0, "a version records when it was made"
    assert catalog.latest("fin") == second, "the latest is the last registered"
    with pytest.raises(AttributeError):
        first.source = "/elsewhere"  # type: ignore[misc]


def test_old_versions_are_retired_beyond_the_bound_except_protected_ones():
    protected = {1}
    catalog = VersionCatalog(FakeClock(), versions_kept=2, protected=lambda name: protected)
    catalog.register("fin", "/a", "h1")
    catalog.register("fin", "/b", "h2")
    _, retired = catalog.register("fin", "/c", "h3")
    assert [v.number for v in retired] == [2], "the oldest unprotected version is retired"
    assert [v.number for v in catalog.versions("fin")] == [1, 3], "the protected version stays"
    with pytest.raises(AdapterVersionNotFoundError, match="retired"):
        catalog.get("fin", 2)
    protected.add(3)
    with pytest.raises(RequestError, match="all in use by a release"):
        catalog.register("fin", "/d", "h4")


def test_the_number_of_names_is_bounded():
    catalog = VersionCatalog(FakeClock(), max_names=2)
    catalog.register("a", "/a", "h")
    catalog.register("b", "/b", "h")
    with pytest.raises(RequestError, match="at most 2 adapter names"):
        catalog.register("c", "/c", "h")
    catalog.forget("a")
    assert catalog.register("c", "/c", "h")[0].number == 1, "a forgotten name frees its room"


def test_a_version_never_registered_is_not_found():
    catalog = VersionCatalog(FakeClock())
    catalog.register("fin", "/a", "h")
    with pytest.raises(AdapterVersionNotFoundError, match="no such version"):
        catalog.get("fin", 7)


def test_the_catalog_survives_a_restart():
    catalog = VersionCatalog(FakeClock())
    catalog.register("fin", "/a", "h1")
    catalog.register("fin", "/b", "h2")
    again = VersionCatalog(FakeClock())
    again.restore(catalog.to_dict())
    assert again.versions("fin") == catalog.versions("fin"), "the versions come back as they were"
    assert again.register("fin", "/c", "h3")[0].number == 3, "numbering continues after a restart"


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
