"""`aerie logs TRAIN_ID DEST` and the hint that prints it: a training's TensorBoard files copied
from the store through aerie's own client (no MinIO client, no alias to configure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from aerie import layout
from aerie.training import logs_hint
from tests.services import clean_env, store_env

AERIE = str(Path(sys.executable).with_name("aerie"))


def test_the_hint_names_the_bucket_and_a_command_that_copies_the_files(s3_store, tmp_path):
    prefix = layout.train_logs_prefix("d-123")
    events = "events.out.tfevents.1700000000.host.1.0"
    s3_store.put_bytes(prefix + events, b"tb-bytes")
    s3_store.put_bytes(prefix + "sub/events.out.tfevents.2", b"not at the top")  # never written by aerie
    hint = logs_hint(s3_store.url, prefix)
    assert f"/{s3_store.bucket}/{prefix}" in hint and "<bucket>" not in hint and "mc " not in hint, hint
    command = hint.splitlines()[-1].strip().split(" && ")[0]
    assert command == "aerie logs d-123 ./tb", hint

    env = clean_env(**store_env(s3_store))
    out = subprocess.run([AERIE, *command.split()[1:]], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [events]
    assert (tmp_path / "tb" / events).read_bytes() == b"tb-bytes"


def test_aerie_logs_refuses_a_path_and_an_unknown_training_in_one_line(fs_store, tmp_path):
    env = clean_env(AERIE_STORE=fs_store.url)
    for train_id, says in (("../x", "is not a train id"), ("nosuch", "no TensorBoard files of training 'nosuch'")):
        out = subprocess.run([AERIE, "logs", train_id, str(tmp_path / "tb")], env=env, capture_output=True, text=True)
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "tb").exists()
