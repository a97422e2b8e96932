"""The bitmask unpack and apply of engine.sample.token_mask equal a plain reference on random masks.

The reference reads each token's bit one at a time (token j is bit j % 32 of int32 word j // 32,
llguidance's layout) and builds the expected logits cell by cell: a constrained row keeps a logit
where its bit is set and the column is inside the vocabulary, and has -inf elsewhere (columns of
logits padded wider than the vocabulary included); every other row is unchanged.
"""

from __future__ import annotations

import pytest
import torch

from lora_cluster.engine.sample.token_mask import (
    allowed_tokens,
    mask_rows_,
    unpack_bitmask_numpy,
    unpack_bitmask_torch,
)

# (vocabulary, logits width): multiples of 32 and not, a partial last word, padded logits
SHAPES = [(1, 1), (31, 31), (32, 32), (33, 33), (500, 500), (512, 512), (1000, 1024), (500, 512), (64, 100)]


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random int32 words, every bit (the sign bit and the padding bits past `vocab` included) random."""
    g = torch.Generator().manual_seed(seed)
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


def reference_allowed(bitmask: torch.Tensor, vocab: int, width: int) -> torch.Tensor:
    out = torch.zeros((bitmask.shape[0], width), dtype=torch.bool)
    for r, row in enumerate(bitmask.tolist()):
        for j in range(vocab):
            out[r, j] = bool((row[j // 32] >> (j % 32)) & 1)
    return out


@pytest.mark.parametrize(("vocab", "width"), SHAPES)
@pytest.mark.parametrize("unpack", [unpack_bitmask_numpy, unpack_bitmask_torch])
def test_unpacked_bits_equal_the_reference(unpack, vocab: int, width: int) -> None:
    bitmask = random_bitmask(5, vocab, seed=vocab + width)
    got = unpack(bitmask, vocab, width)
    assert torch.equal(got, reference_allowed(bitmask, vocab, width)), (
        f"{unpack.__name__} differs from the reference for vocabulary {vocab}, width {width}")


@pytest.mark.parametrize(("vocab", "width"), SHAPES)
def test_masked_rows_equal_the_reference(vocab: int, width: int) -> None:
    g = torch.Generator().manual_seed(vocab * 7 + width)
    logits = torch.randn((12, width), generator=g)
    rows = torch.tensor([0, 3, 4, 9, 11])
    bitmask = random_bitmask(len(rows), vocab, seed=width)
    allowed = reference_allowed(bitmask, vocab, width)
    expected = logits.clone()
    for k, r in enumerate(rows.tolist()):
        for j in range(width):
            if not allowed[k, j]:
                expected[r, j] = float("-inf")
    got = mask_rows_(logits.clone(), bitmask, rows, vocab)
    assert torch.equal(got, expected), f"masked logits differ for vocabulary {vocab}, width {width}"


def test_masking_is_in_place_and_leaves_the_free_rows_bit_for_bit() -> None:
    logits = torch.randn((6, 40))
    before = logits.clone()
    out = mask_rows_(logits, torch.zeros((2, 2), dtype=torch.int32), torch.tensor([1, 4]), 40)
    assert out.data_ptr() == logits.data_ptr(), "the logits are masked in place"
    assert torch.equal(logits[[0, 2, 3, 5]], before[[0, 2, 3, 5]]), "unconstrained rows are unchanged"
    assert bool(torch.isneginf(logits[[1, 4]]).all()), "a row whose mask is empty is all -inf"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_path_equals_the_cpu_path() -> None:
    bitmask = random_bitmask(8, 1000, seed=1)
    logits = torch.randn((16, 1024))
    rows = torch.tensor([1, 2, 5, 8, 9, 10, 14, 15])
    on_cpu = mask_rows_(logits.clone(), bitmask, rows, 1000)
    on_device = mask_rows_(logits.cuda(), bitmask, rows, 1000).cpu()
    assert torch.equal(on_device, on_cpu), "the accelerator's unpack and apply equal the CPU's"


def test_a_bitmask_too_short_for_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot cover 100 tokens"):
        allowed_tokens(torch.zeros((1, 3), dtype=torch.int32), 100, 100, torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot cover 100 tokens"):
        allowed_tokens(torch.zeros((1, 4), dtype=torch.int32), 100, 90, torch.device("cpu"))


def test_the_forward_pass_inference_tensors_are_masked_in_place() -> None:
    with torch.inference_mode():
        logits = torch.randn((4, 64))
    out = mask_rows_(logits, torch.zeros((1, 2), dtype=torch.int32), torch.tensor([2]), 64)
    assert out.data_ptr() == logits.data_ptr(), "an inference tensor is masked in place"
    assert bool(torch.isneginf(logits[2]).all()), "its constrained row is masked"
