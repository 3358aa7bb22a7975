"""Producers at scale obey the request budget (issue 29, "producers linear in the pool"):
a pool that starts together claims its epochs in at most about P create-only PUTs on the
log (tickets folded by whoever commits: ``commit.claims``), not P**2 or P log P.
Counted on the counting store of ``bench scale``, never timed. Group producers' following
within the budget on the head key is ``test_group``'s."""

from __future__ import annotations

import random

import pytest

from batchweave.commit.policies import ClaimBackoff
from batchweave.errors import ConfigError
from benchmarks.scale_pool import FAST, claims


def test_a_lost_claim_backs_off_with_full_jitter_doubling_to_a_cap():
    rng, expected = random.Random(3), random.Random(3)
    backoff = ClaimBackoff(min_attempt_s=0.01, max_s=1.0, rng=rng)
    pauses = [backoff.pause_s(0.05) for _ in range(6)]
    bounds = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # two attempts' time, doubling, capped
    assert pauses == [expected.uniform(0, b) for b in bounds]
    assert ClaimBackoff(min_attempt_s=0.01, rng=random.Random(0)).pause_s(0.0) <= 0.02  # a floor under instant stores
    with pytest.raises(ConfigError):
        ClaimBackoff(max_s=0)


def test_sixty_four_producers_starting_together_claim_without_racing_each_other_p_times():
    """Retried at once, 64 claims took about 23 PUTs each on this latency (1,495 in all);
    with backoff about 5 (342); with tickets at most one each, and far fewer versions."""
    producers = 64
    record = claims(producers, FAST)
    assert record["log_puts"] <= 1.25 * producers, record
