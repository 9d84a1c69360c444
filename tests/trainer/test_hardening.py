"""Issue 35's trainer findings, each against real files and a real S3 server: what a message names
is opened only inside the allowed folders, corrupt inputs are refused by name, a rerun completes a
half-published drafter."""

from __future__ import annotations

import pytest

from aerie.contracts import TrainRequest
from aerie.datasets import DatasetRefused
from aerie_trainer.job import eval_prompts


def _request(**kw) -> TrainRequest:
    return TrainRequest(runs=["r1"], drafter="d", model="/nonexistent", **kw)


def test_eval_prompts_file_outside_the_allowed_folders_is_refused_unopened(s3_store, tmp_path):
    """Finding 7: a message's eval_prompts_file naming a private file was read (and its absence was
    an oracle); now a local path outside AERIE_INGEST_LOCAL_DIRS is refused, present or not."""
    private = tmp_path / "private" / "secret.txt"
    private.parent.mkdir()
    private.write_text("do not read me")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in (str(private), str(tmp_path / "private" / "absent.txt"), f"{allowed}/../private/secret.txt"):
        with pytest.raises(DatasetRefused) as refused:
            eval_prompts(s3_store, _request(eval_prompts_file=name), [allowed])
        assert "AERIE_INGEST_LOCAL_DIRS" in str(refused.value) and "do not read me" not in str(refused.value)
    (allowed / "prompts.txt").write_text("hello\n")
    assert eval_prompts(s3_store, _request(eval_prompts_file=str(allowed / "prompts.txt")), [allowed]) == "hello\n"
    (allowed / "out").symlink_to(private)
    with pytest.raises(DatasetRefused, match="outside"):
        eval_prompts(s3_store, _request(eval_prompts_file=str(allowed / "out")), [allowed])
    s3_store.put_bytes("prompts/p.txt", b"from the store\n")
    assert eval_prompts(s3_store, _request(eval_prompts_file="prompts/p.txt"), []) == "from the store\n"
