"""Queue messages refuse every name that would become part of a store key, by the contracts'
patterns, before any work: a refused name is a bad message, never a transient store error."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from aerie import layout
from aerie.contracts import ExtractRequest, TrainRequest


@pytest.mark.parametrize("shard", ["../../etc/x", "000001/../../x", "1", "0000001", "00000a", "000001\n", "٠٠٠٠٠١"])
def test_names_in_queue_messages_are_validated_shard(shard):
    """2026-12-02: `ExtractRequest.shard` was any string; the store refused `..` but as a
    transient error, retried five times."""
    with pytest.raises(ValidationError, match="shard"):
        ExtractRequest(run="r1", shard=shard)
    assert ExtractRequest(run="r1", shard=layout.shard_name(7)).shard == "000007"


@pytest.mark.parametrize(
    "field, value",
    [
        ("runs", ["../r1"]),
        ("runs", ["r1", "a/b"]),
        ("runs", [""]),
        ("train_id", "../../drafters/x"),
        ("train_id", "a b"),
        ("train_id", "v1\n"),
    ],
)
def test_names_in_queue_messages_are_validated_train(field, value):
    """Every run a training reads and its train id (which becomes the drafter version)."""
    fields = {"runs": ["r1"], "drafter": "d", "model": "/models/target", field: value}
    with pytest.raises(ValidationError, match=field):
        TrainRequest(**fields)
    assert TrainRequest(runs=["r1", "r-2.b"], drafter="d", model="m", train_id="t-1").train_id == "t-1"


def test_names_in_keys_match_whole_in_the_layout():
    """A trailing newline passes a `^...$` pattern under Python's `re.match`; the layout matches whole."""
    for build, name in (
        (lambda n: layout.alignment_report("r1", n), "server"),
        (lambda n: layout.train_progress("r1", n), "t1"),
        (lambda n: layout.drafter_bench("d", "v1", n), "sweep"),
    ):
        assert name in build(name)
        with pytest.raises(ValueError):
            build(name + "\n")
    assert layout.record_names(["runs/r/tokens/000001.json", "runs/r/tokens/000001\n.json"]) == ["000001"]
