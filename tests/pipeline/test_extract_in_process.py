"""The embedded run's extract stage (`aerie.app.pipeline.extract_in_process`): shards in flight on
one engine, as a threads-pool worker runs them, storing what one shard at a time stores."""

from __future__ import annotations

import pytest

from aerie import layout
from aerie.app.pipeline import extract_in_process, shards_in_flight
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest
from aerie.settings import Settings
from aerie_extractor.extract import ExtractError, run_extract
from aerie_extractor.ingest import run_ingest
from tests.conftest import POINTS
from tests.runs import DATA


def test_the_hf_engine_on_a_gpu_extracts_two_shards_at_once_and_the_cpu_one():
    assert shards_in_flight(Settings(engine="hf", device="cuda")) == 2
    assert shards_in_flight(Settings(engine="hf", device="cuda:1", worker_concurrency=4)) == 4
    assert shards_in_flight(Settings(engine="hf", device="cpu")) == 1  # each would take a share of torch's threads
    assert shards_in_flight(Settings(engine="hf", device="cpu", worker_concurrency=3)) == 3
    assert shards_in_flight(Settings(engine="sglang", engine_urls=["http://127.0.0.1:1"])) == 1


def test_shards_in_flight_store_what_one_at_a_time_stores_and_the_first_error_stops_the_rest(fs_store, smollm2_path):
    run_ingest(fs_store, Settings(engine="hf", ingest_local_dirs=[DATA]), IngestRequest(
        run="inflight", dataset=str(DATA / "malformed.jsonl"), model=str(smollm2_path), capture_points=POINTS,
        dtype="bfloat16", options=IngestOptions(max_tokens=96, shard_tokens=64),
    ))  # fmt: skip
    names = sorted(
        k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("inflight", "tokens")) if k.endswith(".json")
    )
    assert len(names) >= 3
    two = Settings(engine="hf", tokens_per_batch=96, worker_concurrency=2)  # two at once on the CPU too
    assert shards_in_flight(two) == 2

    with pytest.raises(ExtractError, match="no token shard '000099'"):
        extract_in_process(fs_store, two, "inflight", [names[0], "000099", *names[1:]])
    assert fs_store.exists(layout.shard_record("inflight", "hidden", names[0]))  # the shard before the error is kept
    done = sum(fs_store.exists(layout.shard_record("inflight", "hidden", n)) for n in names)

    assert extract_in_process(fs_store, two, "inflight", names) == done  # what was stored is reused, the rest extracted
    in_flight = {n: fs_store.get_bytes(layout.shard("inflight", "hidden", n)) for n in names}
    for n in names:  # one shard at a time, as before: the same bytes
        fs_store.delete(layout.shard_record("inflight", "hidden", n))
        assert not run_extract(
            fs_store, Settings(engine="hf", tokens_per_batch=96), ExtractRequest(run="inflight", shard=n)
        ).skipped
        assert fs_store.get_bytes(layout.shard("inflight", "hidden", n)) == in_flight[n]
    assert extract_in_process(fs_store, two, "inflight", names) == len(names)
