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


def test_target_weights_are_read_from_safetensors_only(smollm2_path, tmp_path):
    """Finding 8: a folder with a dummy *.safetensors and a real pytorch_model.bin was loaded from
    the pickle, the content pin covering only the dummy. Now the weight files are exactly what
    `use_safetensors=True` loads, a folder without them is refused by name, and the loaders never
    fall back to `.bin`."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from aerie.target import TargetError, describe, weight_files
    from aerie_trainer.evaluate import load_target
    from aerie_trainer.model import DrafterError, load_target_embeddings

    folder = tmp_path / "target"
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    folder.mkdir()
    cfg.save_pretrained(folder)
    torch.save(LlamaForCausalLM(cfg).state_dict(), folder / "pytorch_model.bin")  # pickled weights
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, folder / f)
    save_file({"dummy": torch.zeros(1)}, str(folder / "dummy.safetensors"))
    assert (folder / "pytorch_model.bin").is_file()
    with pytest.raises(TargetError, match=str(folder)):
        describe(folder)
    with pytest.raises(DrafterError, match="never pickled"):
        load_target_embeddings(folder)
    with pytest.raises(OSError):  # transformers finds no safetensors weights: the .bin is not loaded
        load_target(folder)
    save_file({"model.embed_tokens.weight": torch.ones(64, 16)}, str(folder / "model.safetensors"))
    assert weight_files(folder) == [folder / "model.safetensors"]
    pin = describe(folder).weights_sha256
    save_file({"dummy": torch.ones(1)}, str(folder / "dummy.safetensors"))  # never loaded: not pinned
    assert describe(folder).weights_sha256 == pin
    assert load_target_embeddings(folder).shape == (64, 16)


# --- checkpoints, divergence, one-line failures of `aerie train` ------------------------------------

SMALL = dict(records=24, max_tokens=96, shard_sequences=4)
TRAIN_ARGS = ("--steps", "2", "--batch-tokens", "96", "--seq-len", "96", "--ttt-steps", "2", "--draft-vocab", "512")
TRAIN_CONFIG = {"checkpoint_every": 1, "eval_prompts": 0, "holdout_fraction": 0.2, "warmup_steps": 0}


@pytest.fixture(scope="module")
def small_run(cache_dir, smollm2_path):
    from tests.runs import hidden_run_folder

    return hidden_run_folder(cache_dir, smollm2_path, **SMALL)


def _train_cli(store, smollm2_path, *extra: str, config: dict | None = None):
    import json

    from tests.services import clean_env, store_env
    from tests.shared.test_cli_errors import aerie

    env = clean_env(**store_env(store), AERIE_DEVICE="cpu")
    cfg = json.dumps({**TRAIN_CONFIG, **(config or {})})
    return aerie(
        env, "train", "--drafter", "d", "--model", str(smollm2_path), *TRAIN_ARGS, "--train-config", cfg, *extra
    )


def _rewrite(store, key: str, data: bytes, digest_too: bool) -> None:
    """Put `data` at checkpoint file `key`; with digest_too, latest.json records its sha256 (a
    tampering that knows the format, or a bug that writes NaN): only the values check is left."""
    import hashlib
    import json

    store.put_bytes(key, data)
    if digest_too:
        latest_key = key.split("/step-")[0] + "/latest.json"
        latest = json.loads(store.get_bytes(latest_key))
        latest["sha256"][key.rsplit("/", 1)[1]] = hashlib.sha256(data).hexdigest()
        store.put_bytes(latest_key, json.dumps(latest).encode())


def test_corrupted_or_nan_checkpoints_are_refused_in_one_line_never_resumed(s3_store, small_run, smollm2_path):
    """Issue 35, finding 2 (checkpoints): a checkpoint carried no hash, and a NaN planted in one was
    resumed and published. Now latest.json records each file's sha256; a changed byte, a missing
    file, a NaN (even with its digest rewritten), a renamed tensor and a record without digests are
    each refused in one line naming the file, before anything is trained or published — through
    the real `aerie train` on a real S3 server."""
    import json

    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    from aerie import layout
    from aerie_trainer.checkpoint import Checkpointer, CheckpointRefused, TrainerState
    from tests.runs import upload_run
    from tests.shared.test_cli_errors import one_line

    upload_run(s3_store, small_run, "r1")
    first = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "t1", "--no-publish")
    assert first.returncode == 0, first.stderr[-3000:]
    latest = json.loads(s3_store.get_bytes(layout.checkpoint_latest("t1")))
    prefix = layout.checkpoint_prefix("t1", 2)
    assert latest["step"] == 2 and set(latest["sha256"]) == {
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "trainer.json",
    }
    model_key = prefix + "model.safetensors"
    good = s3_store.get_bytes(model_key)
    good_latest = s3_store.get_bytes(layout.checkpoint_latest("t1"))
    ckpt = Checkpointer(s3_store, "t1")
    assert ckpt.load() is not None  # as written: resumable

    # one flipped byte in the weights: the resume through the CLI (publishing) refuses it
    bad = bytearray(good)
    bad[-5] ^= 0x01
    s3_store.put_bytes(model_key, bytes(bad))
    out = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "t1", "--steps", "3")
    line = one_line(out, model_key, "sha256", "delete the store prefix checkpoints/t1/")
    assert "not resumed" in line
    assert s3_store.list("drafters/") == []  # nothing published
    assert s3_store.get_bytes(layout.checkpoint_latest("t1")) == good_latest  # latest untouched

    # a NaN planted with its digest rewritten: the values check names the file and the tensor
    weights = st_load(good)
    name = "fc.weight"
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] = float("nan")
    _rewrite(s3_store, model_key, st_save(weights), digest_too=True)
    with pytest.raises(CheckpointRefused, match=f"{model_key} tensor {name} holds non-finite"):
        ckpt.load()

    # a renamed tensor (digest rewritten): refused by the real CLI, naming the file, no traceback
    renamed = st_load(good)
    renamed["fc.renamed"] = renamed.pop("fc.weight")
    _rewrite(s3_store, model_key, st_save(renamed), digest_too=True)
    out = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "t1", "--steps", "3")
    one_line(out, model_key, "does not fit the drafter", "fc.weight")
    assert s3_store.list("drafters/") == []

    # a missing file; a truncated file (digest rewritten); a latest.json without digests
    optimizer = s3_store.get_bytes(prefix + "optimizer.safetensors")
    s3_store.delete(prefix + "optimizer.safetensors")
    with pytest.raises(CheckpointRefused, match=f"{prefix}optimizer.safetensors is missing"):
        ckpt.load()
    s3_store.put_bytes(layout.checkpoint_latest("t1"), good_latest)
    _rewrite(s3_store, model_key, good[:100], digest_too=True)
    with pytest.raises(CheckpointRefused, match=f"{model_key} is not a readable safetensors file"):
        ckpt.load()
    s3_store.put_bytes(layout.checkpoint_latest("t1"), json.dumps({"step": 2, "prefix": prefix}).encode())
    with pytest.raises(CheckpointRefused, match="latest.json is not a checkpoint record"):
        ckpt.load()

    # a non-finite state is never written: latest stays where it was
    s3_store.put_bytes(layout.checkpoint_latest("t1"), good_latest)
    with pytest.raises(CheckpointRefused, match="non-finite"):
        ckpt.save(weights, {"state": {}, "param_groups": []}, TrainerState(step=3))
    assert s3_store.get_bytes(layout.checkpoint_latest("t1")) == good_latest
    assert not s3_store.list(layout.checkpoint_prefix("t1", 3))

    # the checkpoint as written again: resumed by the real CLI, which checkpoints step 3 with digests
    s3_store.put_bytes(model_key, good)
    s3_store.put_bytes(prefix + "optimizer.safetensors", optimizer)
    out = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "t1", "--steps", "3", "--no-publish")
    assert out.returncode == 0 and '"resumed_from": 2' in out.stdout, out.stderr[-3000:]
    assert Checkpointer(s3_store, "t1").load()[2].step == 3


def test_a_loss_that_turns_non_finite_stops_before_anything_is_published(s3_store, small_run, smollm2_path):
    """Issue 35, finding 2 (divergence): NaN weights were published and `latest` moved to them.
    Driven for real: drafter v1 is published; a second training of it with a learning rate of
    1e30 (AdamW's first step moves each weight by about the learning rate) overflows the forward,
    and the loss turns non-finite. The real `aerie train` stops in one line naming the loss and
    the learning rate; no version is added, `latest` still names v1, no NaN checkpoint is kept."""

    from safetensors.torch import load as st_load

    from aerie import layout
    from aerie_trainer.checkpoint import Checkpointer
    from tests.runs import upload_run
    from tests.shared.test_cli_errors import one_line

    upload_run(s3_store, small_run, "r1")
    first = _train_cli(s3_store, smollm2_path, "--runs", "r1")
    assert first.returncode == 0, first.stderr[-3000:]
    v1 = s3_store.get_bytes(layout.drafter_latest("d"))
    published = s3_store.list("drafters/d/")

    out = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--lr", "1e30", "--train-id", "exploding")
    line = one_line(out, "training exploding", "lr=1e+30")
    assert "loss turned nan" in line or "non-finite" in line, line
    assert s3_store.list("drafters/d/") == published  # no second version, not a byte more
    assert s3_store.get_bytes(layout.drafter_latest("d")) == v1
    assert "at step 2" in line  # step 1's update is finite (about 1e30); step 2's forward overflows
    assert Checkpointer(s3_store, "exploding").latest_step() == 1  # the last finite step, resumable
    weights = st_load(s3_store.get_bytes(layout.checkpoint_prefix("exploding", 1) + "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in weights.values() if t.is_floating_point())


def test_aerie_train_on_a_truncated_shard_or_a_run_without_hidden_shards_is_one_line(s3_store, small_run, smollm2_path):
    """Issue 35, finding 10 (tracebacks where one line is promised), through the real `aerie train`
    on a real S3 server: a hidden shard cut short (its record as written, then its record
    rewritten to match the cut bytes) and a run whose hidden shards were never extracted are each
    one line naming the shard or the run and what to do; nothing is checkpointed or published."""
    import hashlib

    from aerie import layout
    from aerie.contracts import ShardRecord
    from tests.runs import upload_run
    from tests.shared.test_cli_errors import one_line

    upload_run(s3_store, small_run, "r1")
    key = layout.shard("r1", "hidden", "000000")
    whole = s3_store.get_bytes(key)
    s3_store.put_bytes(key, whole[: len(whole) // 2])
    one_line(_train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "cut"), key, "re-extract")

    cut = whole[:-1000]  # the record agrees with the cut bytes: the header still names the missing tail
    s3_store.put_bytes(key, cut)
    record_key = layout.shard_record("r1", "hidden", "000000")
    record = s3_store.get_json(record_key, ShardRecord)
    s3_store.put_json(
        record_key, record.model_copy(update={"sha256": hashlib.sha256(cut).hexdigest(), "bytes": len(cut)})
    )
    one_line(_train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "cut"), key, "truncated")

    upload_run(s3_store, small_run, "r2")
    s3_store.delete_prefix(layout.shards_prefix("r2", "hidden"))
    one_line(_train_cli(s3_store, smollm2_path, "--runs", "r2", "--train-id", "none"), "run 'r2' has no hidden shards")
    assert s3_store.list("drafters/") == [] and s3_store.list("checkpoints/cut/step-") == []
    assert s3_store.list("checkpoints/none/step-") == []


def test_the_best_checkpoint_is_checked_before_it_is_published(s3_store):
    """`publish_checkpoint: best` publishes checkpoints/<id>/best/: its sha256 is recorded in the
    metrics when written (so in the step checkpoints after it) and checked before it is loaded for
    publishing; a changed byte, or a NaN with the digest rewritten, is refused by name (real S3)."""
    import hashlib

    import torch
    from safetensors.torch import save as st_save

    from aerie import layout
    from aerie_trainer.checkpoint import CheckpointRefused
    from aerie_trainer.job import _load_best

    full = torch.nn.Linear(4, 4)
    best = {k: torch.full_like(v, 0.5) for k, v in full.state_dict().items()}
    data = st_save(best)
    key = layout.checkpoint_best("t")
    s3_store.put_bytes(key, data)
    metrics = {"best_step": 2, "best_acceptance": 1.5, "best_sha256": hashlib.sha256(data).hexdigest()}
    last = _load_best(s3_store, "t", full, dict(metrics))  # as written: loaded
    assert bool((full.weight == 0.5).all()) and set(last) == {"weight", "bias"}

    s3_store.put_bytes(key, data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointRefused, match=f"{key} has sha256 .* recorded when it was written"):
        _load_best(s3_store, "t", full, dict(metrics))
    best["weight"][0, 0] = float("nan")
    nan = st_save(best)
    s3_store.put_bytes(key, nan)
    with pytest.raises(CheckpointRefused, match=f"{key} tensor weight holds non-finite"):
        _load_best(s3_store, "t", full, {**metrics, "best_sha256": hashlib.sha256(nan).hexdigest()})


def test_aerie_train_on_a_run_deleted_and_created_again_trains_again(s3_store, small_run, smollm2_path):
    """Issue 35, finding 10 (the once claim), for a training asked directly: `aerie train` on a run
    deleted and created again (same name, a new plan) answered "already published" with the old
    data's drafter, as its train id was derived from the request alone. Now the request follows the
    run's creation (controller.following), as a planned training does: the same command on the
    same creation finds its drafter published, on the new creation trains a new version, which
    `latest` then names. A train id the user chose, published before the run was created again, is
    refused in one line naming --train-id; nothing is trained under it."""
    import time

    from aerie import controller, layout
    from aerie.contracts import IngestRequest
    from tests.runs import upload_run
    from tests.shared.test_cli_errors import one_line

    def create() -> None:
        s3_store.delete_prefix(layout.run_prefix("r1"))
        ingest = IngestRequest(
            run="r1", dataset="datasets/a.jsonl", model=str(smollm2_path), capture_points=[2, 15, 27]
        )
        controller.create_plan(s3_store, controller.new_plan(ingest))
        upload_run(s3_store, small_run, "r1")

    def versions() -> set[str]:
        return {k.split("/")[2] for k in s3_store.list("drafters/d/") if k.count("/") == 3}

    create()
    first = _train_cli(s3_store, smollm2_path, "--runs", "r1")
    assert first.returncode == 0, first.stderr[-3000:]
    (v1,) = versions()
    again = _train_cli(s3_store, smollm2_path, "--runs", "r1")  # the same creation: the same training
    assert again.returncode == 0 and f"drafter d:{v1} already published" in again.stdout, again.stdout[-2000:]
    assert versions() == {v1}

    time.sleep(1.1)  # created_at has a resolution of a second at worst
    create()
    second = _train_cli(s3_store, smollm2_path, "--runs", "r1")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "already published" not in second.stdout, second.stdout[-2000:]
    (v2,) = versions() - {v1}
    assert s3_store.get_bytes(layout.drafter_latest("d")).decode() == v2

    mine = _train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "mine")
    assert mine.returncode == 0, mine.stderr[-3000:]
    time.sleep(1.1)
    create()
    line = one_line(_train_cli(s3_store, smollm2_path, "--runs", "r1", "--train-id", "mine"), "training mine")
    assert "before run 'r1' was created again" in line and "another --train-id" in line, line
    assert len(versions()) == 3  # v1, v2, mine: none added by the refusal


_EAGER_TRAIN = """
import json, logging, sys
from aerie.queue import TRAIN_TASK, make_app
from aerie.settings import Settings
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(name)s %(message)s")
app = make_app(Settings.load(), include=["aerie_trainer.tasks"])
app.loader.import_default_modules()
sent = app.tasks[TRAIN_TASK].apply(kwargs=json.loads(sys.argv[1]), throw=False)
print(json.dumps({"failed": sent.failed(), "result": str(sent.result)}))
"""


def test_a_train_message_without_follows_logs_and_records_its_failure_under_the_followed_id(
    s3_store, small_run, smollm2_path
):
    """A train message sent by hand (`celery call aerie.train`, no `follows`) runs as the training
    that follows its run's creation (controller.following, in run_train): the worker's log lines and
    a failure's `checkpoints/<train-id>/failed.json` name that training's id, the one `progress` and
    the run controller read, not the id the bare request would have had. The real task, run by an
    eager Celery app (a process of its own, as a worker is) on a real S3 server; the run's hidden
    shards removed, so the job gives up."""
    import json
    import subprocess
    import sys

    from aerie import controller, layout
    from aerie.contracts import IngestRequest, TrainFailure
    from tests.runs import upload_run
    from tests.services import clean_env, store_env

    ingest = IngestRequest(run="r1", dataset="datasets/a.jsonl", model=str(smollm2_path), capture_points=[2, 15, 27])
    plan = controller.new_plan(ingest)
    controller.create_plan(s3_store, plan)
    upload_run(s3_store, small_run, "r1")
    s3_store.delete_prefix(layout.shards_prefix("r1", "hidden"))
    bare = TrainRequest(runs=["r1"], drafter="d", model=str(smollm2_path))
    followed = controller.following(s3_store, bare)
    assert followed.follows == plan.id and followed.resolved_train_id != bare.resolved_train_id

    env = clean_env(**store_env(s3_store), AERIE_BROKER="memory://", AERIE_DEVICE="cpu")
    done = subprocess.run(
        [sys.executable, "-c", _EAGER_TRAIN, bare.model_dump_json()],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    sent = json.loads(done.stdout.splitlines()[-1])
    assert sent["failed"] and "has no hidden shards" in sent["result"], sent
    failure = s3_store.get_json(layout.train_failure(followed.resolved_train_id), TrainFailure)
    assert failure.train_id == followed.resolved_train_id and "has no hidden shards" in failure.error
    assert not s3_store.exists(layout.train_failure(bare.resolved_train_id))
    lines = [line for line in done.stderr.splitlines() if line.startswith("LOG aerie_trainer.tasks ")]
    assert len(lines) == 2 and all(f"training {followed.resolved_train_id}" in line for line in lines), lines
    assert not any(bare.resolved_train_id in line for line in lines), lines


def test_the_same_training_started_twice_at_once_trains_once(s3_store, small_run, smollm2_path):
    """Issue 35, finding 3: the same training started twice trained twice in one checkpoint
    namespace and published twice. Two real `aerie train` processes of one request, started
    together (real S3; no broker, so the train id's lease is a lock file of this host): one trains
    and publishes, the other waits for it and answers "already published"; one version, one
    checkpoint namespace."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.runs import upload_run

    upload_run(s3_store, small_run, "r1")
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: _train_cli(s3_store, smollm2_path, "--runs", "r1"), range(2)))
    assert [o.returncode for o in outs] == [0, 0], [o.stderr[-2000:] for o in outs]
    waited = [o for o in outs if "already published" in o.stdout]
    assert len(waited) == 1, [o.stdout[-1500:] for o in outs]
    versions = {k.split("/")[2] for k in s3_store.list("drafters/d/") if k.count("/") == 3}
    namespaces = {k.split("/")[1] for k in s3_store.list("checkpoints/")}
    assert len(versions) == 1 and namespaces == {f"d-{next(iter(versions))}"}, (versions, namespaces)
