"""The queue's exactly-once claim and retry policy against a real Redis."""

from __future__ import annotations

import pytest

from aerie.queue import claim_once, mark_done, retryable
from aerie.settings import Settings
from aerie.store import InvalidKey, StoreError, _check_key


def test_two_live_deliveries_of_one_task_do_not_both_send(redis_url):
    """A task delivered twice at once (visibility timeout shorter than the task): same owner, both
    find the run complete; only one may send the follow-up. Before: claim_once said yes to both."""
    settings = Settings(broker=redis_url)
    assert claim_once(settings, "train:r1", "task-1")
    assert not claim_once(settings, "train:r1", "task-1")  # the duplicate, while the first is sending
    assert not claim_once(settings, "train:r1", "task-2")  # another owner, ever
    mark_done(settings, "train:r1")
    assert not claim_once(settings, "train:r1", "task-1")  # sent: never again


def test_a_claimant_that_died_before_sending_is_replaced_after_its_sending_mark_expires(redis_url):
    import redis

    settings = Settings(broker=redis_url)
    assert claim_once(settings, "train:r2", "task-1")
    redis.Redis.from_url(redis_url).delete("aerie:once:train:r2:sending")  # its SENDING_TTL_S ran out
    assert claim_once(settings, "train:r2", "task-1")  # the redelivered task sends it


def test_a_refused_key_is_not_retried_but_store_errors_are():
    with pytest.raises(InvalidKey) as refused:
        _check_key("../etc/passwd")
    assert not retryable(refused.value)
    assert retryable(StoreError("unreachable"))
