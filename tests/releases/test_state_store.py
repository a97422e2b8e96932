"""The durable release state (`releases.state_store`): a document in a folder or an S3 object (a real
moto server on 127.0.0.1 that answers one request at a time, `s3_serial`: S3 makes a conditional
write's check and write one step, moto's threaded server does not), read with a tag and written only
over that tag, so that concurrent writers that read, change and retry never lose each other's changes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lora_cluster.errors import ConfigError, ReleaseStateUnavailableError
from lora_cluster.releases.state_store import (
    FolderStateStore,
    MemoryStateStore,
    S3StateStore,
    StateConflict,
    StateStore,
    open_state_store,
)

WRITERS, INCREMENTS = 4, 10


@pytest.fixture(params=["folder", "s3", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> StateStore:
    if request.param == "folder":
        return FolderStateStore(tmp_path / "state")
    if request.param == "memory":
        return MemoryStateStore()
    s3 = request.getfixturevalue("s3_serial")
    return S3StateStore(s3.bucket, "zoo/.lora-cluster")


def increment(store: StateStore) -> int:
    """One read-change-write of the counter, retried on a conflict; returns the tries it took."""
    for tries in range(1, 1000):
        document, tag = store.read()
        count = (document or {}).get("count", 0)
        try:
            store.write({"count": count + 1}, tag)
        except StateConflict:
            continue
        return tries
    raise AssertionError("no write succeeded in 1000 tries")


def test_a_document_is_written_over_the_version_read_only(store):
    assert store.read() == (None, None), "an empty store has no document and no tag"
    tag = store.write({"releases": {"fin": []}}, None)
    document, read_tag = store.read()
    assert document is not None and document["releases"] == {"fin": []}, "the document reads back"
    assert read_tag == tag, "the read's tag is the write's"
    with pytest.raises(StateConflict):
        store.write({"releases": {}}, None)  # as if nothing had been written
    store.write({"releases": {"fin": [1]}}, tag)
    with pytest.raises(StateConflict):
        store.write({"releases": {}}, tag)  # the tag of a document that was replaced since
    assert store.read()[0]["releases"] == {"fin": [1]}, "a refused write changed nothing"


def test_concurrent_writers_that_retry_lose_no_change(store):
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            for _ in range(INCREMENTS):
                increment(store)
        except BaseException as exc:  # a writer that dies would lose its increments unseen
            errors.append(exc)

    threads = [threading.Thread(target=writer) for _ in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, f"no writer failed: {errors!r}"
    assert not any(t.is_alive() for t in threads), "every writer finished within 120 s"
    assert store.read()[0]["count"] == WRITERS * INCREMENTS, "every writer's increments are in the document"


def race(store: StateStore, tag: str, round_: int) -> tuple[list[str], list[int]]:
    """WRITERS threads write over `tag` at once; returns the winners' tags and the conflicted writers."""
    barrier, winners, conflicts = threading.Barrier(WRITERS), [], []

    def writer(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            winners.append(store.write({"round": round_, "writer": i}, tag))
        except StateConflict:
            conflicts.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return winners, conflicts


def test_of_writers_racing_over_one_tag_exactly_one_wins(store):
    tag = store.write({"round": -1}, None)
    for round_ in range(5):
        winners, conflicts = race(store, tag, round_)
        assert (len(winners), len(conflicts)) == (1, WRITERS - 1), (
            f"round {round_}: one write over the tag wins, the others conflict: "
            f"{len(winners)} won, {len(conflicts)} conflicted")
        document, tag = store.read()
        assert tag == winners[0], f"round {round_}: the winner's tag is the document's"
        assert document["round"] == round_, f"round {round_}: the winner's document is read"


def test_a_folder_write_is_atomic_and_leaves_no_temporary_file(tmp_path):
    store = FolderStateStore(tmp_path)
    tag = None
    for i in range(5):
        tag = store.write({"n": i}, tag)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["releases.json", "releases.json.lock"], f"the document and its lock only: {names}"


def test_a_torn_or_unreadable_document_is_a_503_error_not_a_silent_reset(tmp_path):
    (tmp_path / "releases.json").write_text('{"releases": ')
    with pytest.raises(ReleaseStateUnavailableError, match="not a JSON document"):
        FolderStateStore(tmp_path).read()


def test_the_configured_location_picks_the_store(tmp_path):
    folder = open_state_store(str(tmp_path / "s"), [])
    beside = open_state_store("adapter_source", ["s3://bucket/zoo/"])
    assert open_state_store("", [str(tmp_path)]) is None, "empty: the ingress's memory"
    assert isinstance(folder, FolderStateStore), "a path is a folder"
    assert isinstance(beside, S3StateStore), "adapter_source under an S3 source: an S3 object"
    assert beside.where == "s3://bucket/zoo/.lora-cluster/releases.json", (
        "adapter_source: a .lora-cluster prefix under the first source")
    with pytest.raises(ConfigError, match="adapter_source"):
        open_state_store("adapter_source", ["hf://org/zoo"])
    with pytest.raises(ConfigError, match="release_state_uri"):
        open_state_store("gs://bucket/x", [])


def test_an_unreachable_s3_is_a_503_error_naming_no_credentials(s3):
    s3.point_at("http://127.0.0.1:9")  # nothing listens there
    store = S3StateStore(s3.bucket, "state")
    with pytest.raises(ReleaseStateUnavailableError) as caught:
        store.read()
    assert "s3" in str(caught.value), f"the error names the kind of store: {caught.value}"
    assert "testing" not in str(caught.value), f"and no credential: {caught.value}"
