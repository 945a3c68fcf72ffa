"""The keyed digest a worker answers a timed trace with (evaluator.guards.output_digest)."""
from __future__ import annotations

import pytest
import torch

from evaluator.guards import digest_key, output_digest

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_digest_is_the_same_on_every_device_and_changes_with_any_bit(device, test_seed):
    gen = torch.Generator().manual_seed(test_seed)
    vocab = 32000
    rows = torch.randn(9, vocab, generator=gen) * 30
    key = digest_key(vocab, gen)
    expected = output_digest(rows, key)
    assert output_digest(rows.to(device), key.to(device)).cpu().tolist() == expected.tolist()
    flipped = rows.clone()
    flipped.view(torch.int32)[4, 777] ^= 1          # the last bit of one value
    changed = output_digest(flipped, key)
    assert changed[4] != expected[4] and torch.equal(changed[:4], expected[:4])


def test_digest_does_not_follow_the_sum_of_logits(test_seed):
    """Two rows with the same sum (what lm_head's column sums would give a cheat) differ."""
    gen = torch.Generator().manual_seed(test_seed)
    a = torch.randint(-50, 50, (1, 4096), generator=gen).float()   # sums exact in any order
    b = a.roll(1, dims=1)
    key = digest_key(4096, gen)
    assert a.sum() == b.sum() and output_digest(a, key) != output_digest(b, key)
