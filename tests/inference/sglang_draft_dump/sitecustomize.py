"""Test-only: records what SGLang's MLA EAGLE-3 drafter computes, call by call, so a test can
compare SGLang's own module with aerie's on the same weights and inputs.

Put this folder first on an SGLang server's PYTHONPATH (tests/sglang_server.py passes `env`) with
`AERIE_DRAFT_DUMP=<folder>`: every process of the server imports it at start (Python's
`sitecustomize`), and when SGLang imports `sglang.srt.models.kimi_k25_eagle3` its
`Eagle3DeepseekV2ForCausalLM.forward` is wrapped to write, for each of its first calls, the
forward mode, input ids, positions, the hidden states handed in (`spec_info.hidden_states`:
the target's captured states before `fc`, or the previous draft step's output) and what it
returns (the logits of the rows SGLang keeps, and the hidden states for the next step) as
`<folder>/call-<n>.safetensors`. Without `AERIE_DRAFT_DUMP` nothing is patched."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODULE = "sglang.srt.models.kimi_k25_eagle3"
MAX_CALLS = 64


def _wrap(module) -> None:
    import torch
    from safetensors.torch import save_file

    cls = module.Eagle3DeepseekV2ForCausalLM
    forward, folder, calls = cls.forward, os.environ["AERIE_DRAFT_DUMP"], [0]

    def recorded(self, input_ids, positions, forward_batch, *args, **kwargs):
        hidden_in = forward_batch.spec_info.hidden_states.detach().clone()
        out = forward(self, input_ids, positions, forward_batch, *args, **kwargs)
        if calls[0] < MAX_CALLS:
            tensors = {
                "input_ids": input_ids.detach().cpu().contiguous(),
                "positions": positions.detach().cpu().contiguous(),
                "hidden_in": hidden_in.float().cpu().contiguous(),
                "logits": out.next_token_logits.detach().float().cpu().contiguous(),
            }
            if getattr(out, "hidden_states", None) is not None:
                tensors["hidden_out"] = out.hidden_states.detach().float().cpu().contiguous()
            mode = forward_batch.forward_mode.name
            save_file(tensors, os.path.join(folder, f"call-{calls[0]:03d}.safetensors"), metadata={"mode": mode})
            calls[0] += 1
        return out

    cls.forward = torch.no_grad()(recorded)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _wrap(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("AERIE_DRAFT_DUMP"):
    sys.meta_path.insert(0, _Finder())
