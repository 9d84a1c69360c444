"""The queue's exactly-once claim and retry policy against a real Redis."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from aerie.queue import claim_once, held, mark_done, retryable
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


HOLDER = """
import sys, time
from aerie.queue import held
from aerie.settings import Settings
with held(Settings(broker=sys.argv[1]), "regenerate:r1:000000", ttl_s=1.0):
    print("holding", flush=True)
    time.sleep(120)
"""


def test_a_second_delivery_waits_for_the_live_holder_and_takes_over_once_it_is_killed(redis_url):
    """Two live deliveries of one regenerate task (its broker connection lost, the task requeued while
    it runs): the second waits while the first lives, renewing its 1 s lease, and takes the shard
    over within about that second once the first is SIGKILLed; a released lease is taken at once."""
    from tests.services import clean_env

    settings = Settings(broker=redis_url)
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_url], stdout=subprocess.PIPE, text=True, env=clean_env()
    )
    try:
        assert first.stdout.readline().strip() == "holding"
        second = threading.Event()

        def deliver_again():
            with held(settings, "regenerate:r1:000000", ttl_s=1.0):
                second.set()

        threading.Thread(target=deliver_again, daemon=True).start()
        assert not second.wait(4), "the second delivery ran while the first was alive"
    finally:
        first.kill()
        first.wait(10)
    killed = time.monotonic()
    assert second.wait(10), "the second delivery never took over from the killed one"
    assert time.monotonic() - killed < 3  # the lease lapsed (1 s) and the waiter polls every 0.2 s

    with held(settings, "regenerate:r1:000000", ttl_s=30):
        pass
    started = time.monotonic()
    with held(settings, "regenerate:r1:000000", ttl_s=30):  # released: not waited for
        assert time.monotonic() - started < 1


def test_a_refused_key_is_not_retried_but_store_errors_are():
    with pytest.raises(InvalidKey) as refused:
        _check_key("../etc/passwd")
    assert not retryable(refused.value)
    assert retryable(StoreError("unreachable"))


def test_broker_password_never_printed_and_wrong_password_is_an_auth_failure(private_redis):
    """issue 35 finding 6: check_broker printed the broker URL's password and called a wrong
    password "unreachable"; now the URL is redacted and the cause is the credentials."""
    import redis

    from aerie.queue import QueueError, check_broker, make_app
    from aerie.settings import redact

    redis.Redis.from_url(private_redis).config_set("requirepass", "right-pw-1234")
    bad = private_redis.replace("redis://", "redis://:wrong-pw-5678@")
    with pytest.raises(QueueError) as refused:
        check_broker(make_app(Settings(broker=bad)))
    line = str(refused.value)
    assert "wrong-pw-5678" not in line and "***@" in line
    assert "refused the credentials" in line and "unreachable" not in line
    assert redact("redis://user:pw@h:1/0") == "redis://***@h:1/0"
    assert redact("redis://:pw@[::1]:6379/2") == "redis://***@[::1]:6379/2"
    assert redact("memory://") == "memory://"
    assert redact("http://h:9000") == "http://h:9000"
