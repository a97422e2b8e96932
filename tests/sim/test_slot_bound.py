"""The pinned-slot bound (`sim.slot_bound`) on cases computed by hand."""

from __future__ import annotations

import math

import pytest

from lora_cluster.sim.slot_bound import pinned_slot_bound, static_ceiling


def test_without_hold_time_the_bound_is_the_share_of_the_adapters_that_fit() -> None:
    bound = pinned_slot_bound({"a": 50, "b": 30, "c": 20}, slots=2, max_num_seqs=4, hold_s=0.0, window_s=10)
    assert bound == pytest.approx(0.8), "W = 0: the tail holds no slot, the two most requested adapters fit"


def test_the_next_adapter_counts_by_the_share_of_its_slot_that_fits() -> None:
    # x = 0.1 each: S(0) = 2 (1 - e^-0.1), S(1) = 1 + (1 - e^-0.1); H(0) = 20 (1 - e^-0.1),
    # H(1) = 10 + 10 (1 - e^-0.1); share = (1 - S(0)) / (S(1) - S(0)); H = H(0) + share (H(1) - H(0)) = 10
    bound = pinned_slot_bound({"a": 10, "b": 10}, slots=1, max_num_seqs=4, hold_s=1.0, window_s=100)
    assert bound == pytest.approx(0.5), "10 hits of 20 requests"


def test_a_busy_adapter_pins_a_slot_per_full_batch() -> None:
    # x = (130, 1): pinning a costs ceil(130 / 64) = 3 slots; with 3 slots the rest is b's tail share
    n, w, t = {"a": 130, "b": 1}, 10.0, 10.0
    tail_b = 1 - math.exp(-1.0)
    s0 = (1 - math.exp(-130.0)) + tail_b
    more_a = 3 - (1 - math.exp(-130.0))
    share = (3 - s0) / more_a
    h0 = 130 * (1 - math.exp(-130.0)) + tail_b
    expected = (h0 + share * (130 - 130 * (1 - math.exp(-130.0)))) / 131
    assert pinned_slot_bound(n, slots=3, max_num_seqs=64, hold_s=w, window_s=t) == pytest.approx(expected), (
        "a busy adapter takes one slot per batch of its concurrent requests")


def test_every_adapter_pinned_is_every_request_a_hit_and_a_crowded_tail_is_scaled() -> None:
    assert pinned_slot_bound({"a": 5, "b": 5}, slots=8, max_num_seqs=4, hold_s=1.0, window_s=10) == 1.0, (
        "all adapters fit: every request is a hit")
    # ten adapters of x = 2 each: S(0) = 10 (1 - e^-2) > 4 slots, so H(0) is scaled by 4 / S(0)
    tail = 1 - math.exp(-2.0)
    ten = {str(i): 20 for i in range(10)}
    bound = pinned_slot_bound(ten, slots=4, max_num_seqs=4, hold_s=1.0, window_s=10)
    assert bound == pytest.approx(200 * tail * 4 / (10 * tail) / 200), "the tail alone needs more slots"


def test_no_requests_is_no_bound_and_a_bad_window_is_an_error() -> None:
    assert pinned_slot_bound({}, slots=4, max_num_seqs=4, hold_s=1.0, window_s=10) is None, "no requests"
    with pytest.raises(ValueError, match="window_s"):
        pinned_slot_bound({"a": 1}, slots=4, max_num_seqs=4, hold_s=1.0, window_s=0)


def test_the_static_ceiling_gives_hot_adapters_a_slot_per_full_batch_and_no_slot_to_the_tail() -> None:
    # x = (20, 1, 1) with B = 8: a takes ceil(20 / 8) = 3 slots, b 1; with 4 slots c is out
    completed = {"a": 200, "b": 10, "c": 10}
    ceiling = static_ceiling(completed, slots=4, max_num_seqs=8, hold_s=1.0, window_s=10)
    assert ceiling == pytest.approx(210 / 220), "a (3 slots) and b (1 slot) fit, c does not"


def test_the_static_ceiling_counts_the_next_adapter_by_the_share_of_its_slots_that_fit() -> None:
    # a needs 2 slots (x = 12, B = 8); with 1 slot half of a's requests count
    ceiling = static_ceiling({"a": 120, "b": 40}, slots=1, max_num_seqs=8, hold_s=1.0, window_s=10)
    assert ceiling == pytest.approx(60 / 160), "one of a's two slots fits"
    assert static_ceiling({}, slots=1, max_num_seqs=8, hold_s=1.0, window_s=10) is None, "no requests"
