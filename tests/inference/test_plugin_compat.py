"""The plugin's hook points per SGLang release (`aerie_sglang.plugin.compat`), checked against
each release's real source, statically (`aerie_sglang.plugin.source_check`: ast, no import).

- 0.5.17 (the H200's): its wheel from PyPI, downloaded by pip into the test cache at test time
  (sha256 pinned), never imported here (it needs another torch);
- 0.5.23 (the images'): the source installed in `.venv-sglang` (the plugin tests run it too);
- the check is not vacuous: 0.5.23's table against 0.5.17's source, and 0.5.17's source with one
  hook point changed, are both refused, naming what is missing;
- an unsupported release and a bad `AERIE_CAPTURE_LAYER_IDS` refuse in one line.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.sglang_server import REPO, SGLANG_VENV, sglang_python

sys.path.insert(0, str(REPO / "services" / "inference"))  # the plugin's pure-Python modules (no SGLang, no torch)

from aerie_sglang.plugin import PluginRefused  # noqa: E402
from aerie_sglang.plugin.compat import RELEASES, configured_layer_ids, release  # noqa: E402
from aerie_sglang.plugin.source_check import _split, check, source_version  # noqa: E402

# The one wheel of sglang 0.5.17 (pure-Python source; the tags only pick the file), as on PyPI.
WHEEL = "sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "575e38f5683624ded3b4bb267f637a098e5ed37d13a1d1ff5ea09bd781a04d16"


@pytest.fixture(scope="module")
def sglang_0_5_17(cache_dir) -> Path:
    """0.5.17's `sglang/` Python files and dist-info, unpacked once into the test cache."""
    root = Path(cache_dir).expanduser() / "sglang-source" / "0.5.17"
    stamp = root / ".complete"
    if stamp.is_file() and stamp.read_text() == WHEEL_SHA256:
        return root
    download = root.parent / "wheels"
    download.mkdir(parents=True, exist_ok=True)
    wheel = download / WHEEL
    if not wheel.is_file() or hashlib.sha256(wheel.read_bytes()).hexdigest() != WHEEL_SHA256:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "sglang==0.5.17", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
             "--platform", "manylinux_2_34_x86_64", "--dest", str(download), "--quiet"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0 and wheel.is_file(), f"pip download sglang==0.5.17 failed:\n{proc.stderr[-3000:]}"
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        assert digest == WHEEL_SHA256, f"{wheel} has sha256 {digest}, not the pinned {WHEEL_SHA256}"
    shutil.rmtree(root, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [
            m
            for m in zf.namelist()
            if (m.startswith("sglang/") and m.endswith(".py")) or m.endswith(".dist-info/METADATA")
        ]
        for name in members:
            assert ".." not in Path(name).parts and not name.startswith("/"), name
        zf.extractall(root, members)
    stamp.write_text(WHEEL_SHA256)
    return root


@pytest.fixture(scope="module")
def sglang_0_5_23() -> Path:
    sites = sorted((sglang_python().parent.parent / "lib").glob("python3*/site-packages"))
    assert sites, f"no site-packages under {SGLANG_VENV}/lib"
    return sites[0]


def test_every_hook_point_of_0_5_17_is_in_its_wheel(sglang_0_5_17):
    assert source_version(sglang_0_5_17) == "0.5.17"
    assert check(RELEASES["0.5.17"], sglang_0_5_17) == []


@pytest.mark.sglang
def test_every_hook_point_of_0_5_23_is_in_the_installed_sglang(sglang_0_5_23):
    assert source_version(sglang_0_5_23) == "0.5.23"
    assert check(RELEASES["0.5.23"], sglang_0_5_23) == []


def test_0_5_23s_hook_points_are_refused_on_0_5_17s_source(sglang_0_5_17):
    """The differences the two tables exist for, found by the check itself."""
    problems = "\n".join(check(RELEASES["0.5.23"], sglang_0_5_17))
    for missing in (
        "SchedulerOutputStreamer.is_request_level_customized_info_key: 'is_request_level_customized_info_key' is not defined",
        "TokenizerManager.update_request_meta_info: 'update_request_meta_info' is not defined",
        "sglang.srt.utils.common.build_server_info: 'build_server_info' is not defined",
        "LogitsProcessorOutput.last_hidden_states: 'last_hidden_states' is not defined",
        "Req.set_finish_with_abort: has parameters ['self', 'error_msg'], the plugin needs ['status_code', 'err_type']",
    ):
        assert missing in problems, problems


def _copy_modules(src: Path, dst: Path) -> None:
    """The module files 0.5.17's table names (and sglang/__init__.py), copied into `dst`."""
    rel = RELEASES["0.5.17"]
    files = {src / "sglang" / "__init__.py"} | {_split(src, t.target)[0] for t in (*rel.hooks, *rel.uses)}
    for f in files:
        (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dst / f.relative_to(src))


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            (
                "sglang/srt/managers/tokenizer_manager.py",
                "async def _handle_batch_output(",
                "async def _handle_batch_output_v2(",
            ),
            "TokenizerManager._handle_batch_output: '_handle_batch_output' is not defined",
        ),
        (
            (
                "sglang/srt/managers/tokenizer_manager.py",
                "async def _handle_batch_output(",
                "def _handle_batch_output(",
            ),
            "TokenizerManager._handle_batch_output: is def, the hook expects async def",
        ),
        (
            (
                "sglang/srt/layers/logits_processor.py",
                "aux_hidden_states: Optional[AuxHiddenStates] = None,\n        hidden_states_before_norm",
                "hidden_states_before_norm: Optional[torch.Tensor] = None,\n        aux_hidden_states",
            ),
            "LogitsProcessor.forward: has parameters ['self', 'input_ids', 'hidden_states', 'lm_head', 'logits_metadata', "
            "'hidden_states_before_norm', 'aux_hidden_states'], the plugin expects",
        ),
        (
            ("sglang/srt/managers/schedule_batch.py", "self.customized_info:", "self.customized_infos:"),
            "Req.customized_info: 'customized_info' is not defined in Req",
        ),
        (
            (
                "sglang/srt/managers/utils.py",
                "cpu_t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)",
                "cpu_t = _STAGING.setdefault((t.shape, t.dtype), torch.empty(t.shape, dtype=t.dtype))",
            ),
            "_async_d2h: does not copy into new pinned memory",
        ),
    ],
    ids=["renamed", "no-longer-async", "reordered", "field-gone", "d2h-into-a-kept-buffer"],
)
def test_a_changed_hook_point_in_0_5_17s_source_is_refused(sglang_0_5_17, tmp_path, edit, expected):
    _copy_modules(sglang_0_5_17, tmp_path)
    assert check(RELEASES["0.5.17"], tmp_path) == []  # the copy alone passes
    path, old, new = edit
    text = (tmp_path / path).read_text()
    assert text.count(old) == 1, (path, old)
    (tmp_path / path).write_text(text.replace(old, new))
    problems = check(RELEASES["0.5.17"], tmp_path)
    assert len(problems) == 1 and expected in problems[0], problems


def test_an_unsupported_release_refuses_in_one_line():
    with pytest.raises(PluginRefused) as e:
        release("0.5.22")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("aerie_capture plugin refused to load: sglang==0.5.22 is not supported")
    assert "sglang==0.5.23" in message and "sglang==0.5.17" in message


def test_capture_layer_ids_are_read_only_where_the_release_has_no_capture_flags():
    old, new = RELEASES["0.5.17"], RELEASES["0.5.23"]
    assert configured_layer_ids(old, {"AERIE_CAPTURE_LAYER_IDS": "1, 14,26"}) == [1, 14, 26]
    assert configured_layer_ids(old, {"AERIE_CAPTURE_LAYER_IDS": "1 14 26"}) == [1, 14, 26]
    assert configured_layer_ids(old, {}) is None
    assert configured_layer_ids(new, {}) is None
    for bad in ("1,x", "-1", ","):
        with pytest.raises(PluginRefused, match=r"AERIE_CAPTURE_LAYER_IDS=.* is not a list of layer ids"):
            configured_layer_ids(old, {"AERIE_CAPTURE_LAYER_IDS": bad})
    with pytest.raises(PluginRefused, match="--return-aux-hidden-state-layer-ids 1 14 instead"):
        configured_layer_ids(new, {"AERIE_CAPTURE_LAYER_IDS": "1,14"})
