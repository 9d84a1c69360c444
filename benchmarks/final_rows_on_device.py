"""The final (post-norm) rows the capture plugin keeps under a prefill CUDA graph, on a GPU, with
the plugin's own hooks (this checkout's `aerie_sglang.plugin.hooks`, release table 0.5.23).

SGLang 0.5.23 keeps the final rows as `LogitsProcessorOutput.last_hidden_states`, the logits
processor's input itself; under its prefill CUDA graph `_trim_logits_output` returns
`last_hidden_states[:raw_num_tokens]`, a view of the graph's output buffer, and with overlap
scheduling the next batch's replay is launched on the forward stream before this batch's rows are
taken on the scheduler's stream. 0.5.23 does not run on the lent GPUs' torch, so this script
rebuilds that order around a real CUDA graph (a linear layer and an RMSNorm captured on a forward
stream, replayed batch after batch with the next batch launched before the previous one's rows are
taken) and runs the plugin's real `around_trim_logits_output`, `_take_rows` and `_finish` on it:

- `plugin`: the hooks as installed; every capture's final rows must equal the eager forward's;
- `without-copy`: the same order with SGLang's trim alone (the view kept), to show the check can
  fail: the rows are expected to hold a later batch's values.

The whole plugin on a real SGLang under its prefill CUDA graph (0.5.17, the lent GPUs' release) is
`benchmarks/plugin_on_device.py` (`gpu_capture_device.sh verify`). Device side:

    bash benchmarks/gpu_capture_device.sh final-rows      # this script, then `verify`
    PYTHONPATH=services/inference python3 benchmarks/final_rows_on_device.py --out F.json   # alone

Writes `$OUT/final-rows.json`: per mode, the max abs difference and the count of wrong captures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from aerie_sglang.plugin import compat, hooks  # services/inference installed, or on PYTHONPATH
from aerie_sglang.plugin.sink import CaptureSinkSettings


class Output:
    """The fields of 0.5.23's `LogitsProcessorOutput` that its trim and the plugin touch."""

    def __init__(self, hidden_states, last_hidden_states):
        self.hidden_states, self.last_hidden_states = hidden_states, last_hidden_states


class Runner:
    def __init__(self, raw_num_tokens: int):
        self.raw_num_tokens = raw_num_tokens


def trim_0_5_23(runner: Runner, output: Output) -> Output:
    """The rows of 0.5.23's `PrefillCudaGraphRunner._trim_logits_output`: views of the graph's output."""
    n = runner.raw_num_tokens
    return Output(output.hidden_states[:n], output.last_hidden_states[:n])


class Req:
    customized_info = None
    is_retracted = False

    def __init__(self, rid: str):
        self.rid = rid


def run(mode: str, hidden: int, padded: int, batches: int, seed: int) -> dict:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(hidden, hidden).cuda()
    norm = torch.nn.RMSNorm(hidden).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    forward = torch.cuda.Stream()
    static_in = torch.zeros(padded, hidden, device="cuda")
    with torch.no_grad():
        forward.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(forward):
            for _ in range(3):
                norm(layer(static_in))
        torch.cuda.current_stream().wait_stream(forward)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=forward):
            static_aux = layer(static_in)
            static_out = norm(static_aux)

    submitted: list = []
    hooks._sinks.submit = lambda capture, reservation: submitted.append(capture)
    inputs = [
        torch.randn(int(torch.randint(padded // 2, padded + 1, ())), hidden, device="cuda") for _ in range(batches)
    ]
    with torch.no_grad():
        expected = [norm(layer(x)).cpu() for x in inputs]
    pending: list = []

    def take(trimmed, done, index):
        done.synchronize()  # SGLang waits for the batch's copy_done before processing its result
        # the next batch, launched before this result is processed, may have run by now: make it so
        # (the worst case, every time), so that a kept view shows the next batch's rows
        forward.synchronize()
        rows = trimmed.last_hidden_states.shape[0]
        cut = rows // 2  # two requests per batch
        for rid, (start, end) in zip("ab", [(0, cut), (cut, rows)]):
            hooks._take_rows(Req(f"{index}{rid}"), hooks._RequestCapture("shm", None, True), trimmed, start, end, True)

    with torch.no_grad():
        for index, x in enumerate(inputs):
            with torch.cuda.stream(forward):
                static_in[: x.shape[0]].copy_(x)
                graph.replay()
                replayed = Output(static_aux, static_out)
                if mode == "plugin":
                    trimmed = hooks.around_trim_logits_output(trim_0_5_23, Runner(x.shape[0]), replayed)
                else:
                    trimmed = trim_0_5_23(Runner(x.shape[0]), replayed)
                done = torch.cuda.Event()
                done.record()
            pending.append((trimmed, done, index))
            if len(pending) == 2:  # overlap scheduling: the next batch is launched first
                take(*pending.pop(0))
        while pending:
            take(*pending.pop(0))
    torch.cuda.synchronize()
    wrong, worst = 0, 0.0
    for capture in submitted:  # what a writer waits for before reading a capture's host rows
        if capture.ready is not None:
            capture.ready.synchronize()
    # submitted in order: batch i's two requests
    for i, reference in enumerate(expected):
        cut = reference.shape[0] // 2
        for j, (start, end) in enumerate([(0, cut), (cut, reference.shape[0])]):
            got = submitted[2 * i + j].tensors["final"].float()
            diff = (got - reference[start:end]).abs().max().item()
            worst = max(worst, diff)
            wrong += diff > 1e-3
    return {"captures": len(submitted), "wrong": int(wrong), "max_abs_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--padded-tokens", type=int, default=512)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a GPU"
    with tempfile.TemporaryDirectory() as tmp:
        settings = CaptureSinkSettings(shm_dir=Path(tmp) / "cap", max_unclaimed_bytes=1 << 34, ttl_s=60)
        hooks.configure(settings, compat.RELEASES["0.5.23"], "device-check")
        hooks._layer_ids = lambda: [0]
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "hidden": args.hidden,
            "padded_tokens": args.padded_tokens,
            "batches": args.batches,
            "modes": {m: run(m, args.hidden, args.padded_tokens, args.batches, 0) for m in ("plugin", "without-copy")},
        }
    result["verdict"] = (
        "ok: the plugin's rows are its own, and the check catches a kept view"
        if result["modes"]["plugin"]["wrong"] == 0 and result["modes"]["without-copy"]["wrong"] > 0
        else "FAILED"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
