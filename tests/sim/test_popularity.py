"""Zipf popularity (`lora_cluster.sim.popularity`): the simulator, the benchmarks and the load tests
draw adapters with it, and a seed must give the sequence `random.Random.choices` gives with the same
weights, one draw at a time or many at once, so that the docs' seeded figures stay reproducible."""

from __future__ import annotations

import random

import pytest

from lora_cluster.sim.popularity import ZipfSampler, zipf_share, zipf_weights


def test_weights_fall_as_one_over_rank_to_the_power_s() -> None:
    assert zipf_weights(4, 1.0) == [1.0, 0.5, 1 / 3, 0.25], "rank k weighs 1 / (k + 1)^s"


@pytest.mark.parametrize(("n", "s"), [(8, 1.1), (64, 1.1), (1000, 1.0), (1000, 0.8)])
def test_draws_are_the_choices_random_makes_with_the_same_weights(n: int, s: float) -> None:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    expected = random.Random(7).choices(range(n), weights, k=5000)
    assert ZipfSampler(n, s).draws(random.Random(7), 5000) == expected, "same seed, same ranks"


def test_single_draws_interleaved_with_other_uses_of_the_generator_match_choices() -> None:
    sampler, ours, theirs = ZipfSampler(8, 1.1), random.Random(3), random.Random(3)
    weights = zipf_weights(8, 1.1)
    got = [(sampler.draw(ours), ours.randint(8, 32)) for _ in range(2000)]
    expected = [(theirs.choices(range(8), weights)[0], theirs.randint(8, 32)) for _ in range(2000)]
    assert got == expected, "a draw consumes exactly what rng.choices consumes"


def test_extra_weights_add_indexes_after_the_ranks() -> None:
    sampler = ZipfSampler(4, 1.1, extra_weights=[1.0])
    weights = [*zipf_weights(4, 1.1), 1.0]
    expected = random.Random(5).choices(range(5), weights, k=3000)
    assert sampler.draws(random.Random(5), 3000) == expected, "index n is the extra weight (rank 0's here)"


def test_share_of_the_top_ranks() -> None:
    assert zipf_share(4, 1.0, 2) == pytest.approx(1.5 / (1 + 0.5 + 1 / 3 + 0.25)), "top-2 share of 4 at s=1"
    assert ZipfSampler(4, 1.0).share(2) == zipf_share(4, 1.0, 2), "the sampler's share is zipf_share"


def test_no_ranks_is_refused_with_the_count() -> None:
    with pytest.raises(ValueError, match="n=0"):
        ZipfSampler(0, 1.0)
