"""The multi-process helper itself: a failing or hanging rank fails the test instead of blocking it."""

import time

import pytest
import torch.distributed as dist

from tests.helpers.dist import run_distributed


def _rank1_fails_while_rank0_waits(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # never completes: rank 1 is gone


def _everyone_hangs(rank, world_size):
    time.sleep(600)


@pytest.mark.timeout(60)
def test_a_failing_rank_is_reported_and_the_waiting_rank_killed():
    with pytest.raises(AssertionError, match="rank 1 of 2 failed:(.|\n)*boom on rank 1"):
        run_distributed(_rank1_fails_while_rank0_waits, 2, timeout_s=50)


@pytest.mark.timeout(60)
def test_a_hang_fails_at_the_deadline():
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] did not finish within 5 s"):
        run_distributed(_everyone_hangs, 2, timeout_s=5)
