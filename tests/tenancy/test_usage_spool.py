"""The node-local usage spool (`tenancy.usage_spool`, through `serve.ops.usage_shipper`): records of a
process killed with SIGKILL (a real child process, real files in tmp_path, a real SQLite store) reach
the store exactly once through another process's shipper, a batch that landed before the kill is not
counted twice, a live sender's spool is never taken, only one adopter takes a dead one, and the spool
is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord
from lora_cluster.tenancy.usage_spool import UsageSpool
from lora_cluster.tenancy.usage_store import UsageStore

T0 = 1_795_995_600.0

CHILD = """
import asyncio, os, signal, sys, time
from lora_cluster.serve.ops.usage_shipper import UsageShipper
from lora_cluster.tenancy.usage_record import Outcome, UsageRecord
from lora_cluster.tenancy.usage_store import UsageStore

spool, db, landed, kept, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
store = UsageStore(db)
T0 = 1_795_995_600.0

def rec(i):
    return UsageRecord(request_id=f"r{i}", tenant="acme", adapter="a1", version=1, sla_class="standard",
                       base_model="demo", replica="dead", prompt_tokens=10, cached_tokens=0, output_tokens=i,
                       device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=T0)

async def main():
    async def send_landed_reply_lost(batch):
        store.record_batch(batch)  # the batch lands in the store ...
        await asyncio.sleep(3600)  # ... and its reply never comes back

    shipper = UsageShipper(send_landed_reply_lost, owner="dead-replica", background=False, timeout_s=0.05,
                           spool_dir=spool)
    for i in range(landed):
        shipper.add(rec(i))
    if landed:
        assert not await shipper.flush()
    for i in range(landed, landed + kept):
        shipper.add(rec(i))
    print("ready", flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)

asyncio.run(main())
"""


def rec(rid: str) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant="acme", adapter="a1", version=1, sla_class="standard",
                       base_model="demo", replica="live", prompt_tokens=10, cached_tokens=0, output_tokens=3,
                       device_s=0.5, queue_s=0.1, outcome=Outcome.COMPLETED, ended_at=T0)


def child(spool: Path, db: Path, landed: int, kept: int, mode: str) -> subprocess.Popen[str]:
    """A process with its own shipper and spool: `landed` records in a batch that reached the store
    whose reply was lost, `kept` more in its buffer; then SIGKILL (`kill`) or alive (`live`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), str(spool), str(db), str(landed),
                             str(kept), mode], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None, "precondition: the child's output is read"
    assert proc.stdout.readline().strip() == "ready", "precondition: the child has added its records"
    return proc


def killed(spool: Path, db: Path, landed: int, kept: int) -> None:
    proc = child(spool, db, landed, kept, "kill")
    assert proc.wait(timeout=60) == -signal.SIGKILL, "precondition: the child was killed, no graceful stop"


def requests_in(db: Path) -> dict[str, object]:
    store = UsageStore(db)
    try:
        rows = store.query(group_by=())
    finally:
        store.close()
    return rows[0] if rows else {"requests": 0, "output_tokens": 0}


def adopter(spool: Path, db: Path) -> tuple[UsageShipper, UsageStore]:
    store = UsageStore(db)

    async def send(batch):
        store.record_batch(batch)

    return UsageShipper(send, owner="next-replica", background=False, spool_dir=str(spool)), store


async def test_a_killed_senders_records_reach_the_store_through_the_next_sender(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    killed(spool, db, landed=0, kept=5)
    assert requests_in(db)["requests"] == 0, "precondition: nothing reached the store before the kill"
    shipper, store = adopter(spool, db)
    assert await shipper.adopt(), "the dead sender's spool is sent"
    store.close()
    row = requests_in(db)
    assert row["requests"] == 5, f"every record the killed sender had accepted is stored: {row}"
    assert row["output_tokens"] == sum(range(5)), f"with its tokens: {row}"
    assert shipper.adopted == 5, "the adopter counts what it sent"
    assert [p.name for p in spool.iterdir()] == [shipper.source], "the dead sender's folder is gone"


async def test_a_batch_that_landed_before_the_kill_is_not_counted_twice(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    killed(spool, db, landed=3, kept=2)
    assert requests_in(db)["requests"] == 3, "precondition: the first batch landed, its reply was lost"
    shipper, store = adopter(spool, db)
    assert await shipper.adopt(), "the dead sender's spool is sent"
    assert await shipper.adopt(), "nothing is left to adopt"
    store.close()
    row = requests_in(db)
    assert row["requests"] == 5, f"one record per request: the landed batch once, the buffer's added: {row}"
    assert row["output_tokens"] == sum(range(5)), f"each request's tokens once: {row}"


async def test_a_live_senders_spool_is_not_taken(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    proc = child(spool, db, landed=0, kept=2, mode="live")
    try:
        shipper, store = adopter(spool, db)
        assert await shipper.adopt(), "adoption succeeds with nothing to send"
        assert shipper.adopted == 0, "a live sender's records are its own to send"
        assert requests_in(db)["requests"] == 0, "nothing of the live sender's is stored by another"
        proc.kill()
        proc.wait(timeout=30)
        assert await shipper.adopt(), "once it died, its spool is sent"
        assert requests_in(db)["requests"] == 2, "its records then reach the store"
        store.close()
    finally:
        proc.kill()


async def test_only_one_of_two_adopters_takes_a_dead_spool(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    killed(spool, db, landed=0, kept=4)
    first = UsageSpool.open(spool, "first")
    second = UsageSpool.open(spool, "second")
    taken = first.adopt_one()
    assert taken is not None, "the first adopter locks the dead spool"
    assert second.adopt_one() is None, "the second cannot take it while the first holds it"
    taken.release(remove=True)
    assert second.adopt_one() is None, "nor after the first sent it: nothing is left"


async def test_a_graceful_close_leaves_no_spool_and_an_unsent_one_is_left_for_adoption(tmp_path):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    shipper, store = adopter(spool, db)
    shipper.add(rec("r1"))
    await shipper.close()
    assert list(spool.iterdir()) == [], "everything acknowledged: the spool folder is deleted"

    async def down(batch):
        raise ConnectionError("the store is down")

    failing = UsageShipper(down, owner="stopping", background=False, spool_dir=str(spool), timeout_s=0.05)
    failing.add(rec("r2"))
    await failing.close()
    taker, _ = adopter(spool, db)
    assert await taker.adopt(), "the unsent spool is adopted"
    assert requests_in(db)["requests"] == 2, "the record its sender could not send still reaches the store"
    store.close()


async def test_the_open_file_is_bounded_and_a_record_past_it_stays_in_memory(tmp_path):
    spool = UsageSpool.open(tmp_path / "spool", "bounded", max_segment_bytes=1000)
    written = [spool.append(rec(f"r{i}")) for i in range(10)]
    assert not all(written), "records past the bound are not written"
    assert spool.overflowed == written.count(False), "each is counted"
    assert sum(p.stat().st_size for p in spool.folder.glob("*.open")) <= 1000, "the file stays within it"


async def test_dead_spools_past_the_bound_are_deleted(tmp_path):
    root = tmp_path / "spool"
    for i in range(3):
        dead = UsageSpool.open(root, f"dead-{i}")
        dead.append(rec(f"r{i}"))
        dead.close(remove=False)
    spool = UsageSpool.open(root, "live")
    taken = spool.adopt_one(max_dead=2)
    assert taken is not None, "a dead spool within the bound is adopted"
    left = sorted(p.name for p in root.iterdir())
    assert len(left) == 3, f"the adopted one, one more within the bound, and the live one's: {left}"


@pytest.mark.parametrize("landed", [0, 2])
async def test_a_store_restart_in_between_still_takes_each_batch_once(tmp_path, landed):
    spool, db = tmp_path / "spool", tmp_path / "usage.db"
    killed(spool, db, landed=landed, kept=2)
    for _ in range(2):  # two adopters in turn, the store closed and reopened in between
        shipper, store = adopter(spool, db)
        assert await shipper.adopt(), "adoption succeeds"
        store.close()
        await asyncio.sleep(0)
    assert requests_in(db)["requests"] == landed + 2, "each request once"
