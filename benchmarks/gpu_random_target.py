"""An 8B-shaped target whose next token is learnable (issue 39.5): Llama-3.1-8B's shape, random
weights drawn the way tests/targets.py draws the tiny DeepSeek-V3 target (peaked next-token logits,
residual writers and embeddings at spreads that make the states the layers' work), SmolLM2's
tokenizer and chat template. For speed only: it says nothing about language.

    python benchmarks/gpu_random_target.py --tokenizer TOKENIZER_DIR --out DIR [--shape llama3-8b] [--device cuda]

The tiny DeepSeek-V3's spreads are absolute stds at width 64 (`lm_head` 0.4, `o_proj` and
`down_proj` 0.16, embeddings 0.002, norm weights 1 + 0.2 N(0, 1)); here each is the same gain
over its fan-in (`lm_head` 0.4 x sqrt(64) / sqrt(H), ...), so the logits and the residual writes
have the tiny target's scale at any width; the other projections keep transformers' init (0.02).
The weights are drawn on `--device` (a generator per tensor, seeded), written as bf16 safetensors
shards with their index, beside SmolLM2's tokenizer files. Then the folder is loaded back with
transformers and measured on chat prompts: next-token entropy (a flat distribution over 49,152
tokens is 10.80 nats), the mean top-1 probability, and how repetitive a greedy continuation is
(distinct tokens / tokens). Printed, and written to DIR/target.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

SHAPES = {  # Llama config fields
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_hidden_layers=32,
    ),
    "tiny": dict(  # the CPU check of this script
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=8,  # the default capture points need >= 6
    ),
}
TINY_WIDTH = 64  # tests/targets.py's hidden size, where its spreads were measured
GAINS = {"lm_head": 0.4 * 8, "o_proj": 0.16 * 8, "down_proj": 0.16 * math.sqrt(128)}  # std x sqrt(fan-in) there
EMBED_STD, NORM_SPREAD, INIT_STD = 0.002, 0.2, 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a bicycle stays upright.",
    "Give me three tips for a job interview.",
]


def config_for(shape: str, tokenizer_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **SHAPES[shape],
        "vocab_size": len(tok),
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id if tok.bos_token_id is not None else eos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "post_attention_layernorm.weight": (H,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        )
    shapes.update({"model.norm.weight": (H,), "lm_head.weight": (V, H)})
    return shapes


def draw(name: str, shape: tuple[int, ...], generator, device: str):
    """One tensor, bf16: the tiny target's spread for its module, at this fan-in."""
    import torch

    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    module = name.split(".")[-2]
    if name.endswith("norm.weight"):
        x = 1.0 + NORM_SPREAD * x
    elif module == "embed_tokens":
        x = EMBED_STD * x
    elif module in GAINS:
        x = GAINS[module] / math.sqrt(shape[1]) * x
    else:
        x = INIT_STD * x
    return x.to(torch.bfloat16)


def build(out: Path, shape: str, tokenizer_dir: Path, device: str, seed: int, shard_bytes: float) -> dict:
    import torch
    from safetensors.torch import save_file

    cfg = config_for(shape, tokenizer_dir)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shapes = tensor_shapes(cfg)
    index, shard, size, n, total = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            name = f"model-{n:05d}.safetensors"
            save_file({k: v.cpu() for k, v in shard.items()}, str(tmp / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            shard, size = {}, 0

    for i, (name, dims) in enumerate(shapes.items()):
        generator = torch.Generator(device=device).manual_seed(seed * 100003 + i)
        shard[name] = draw(name, dims, generator, device)
        size += shard[name].numel() * 2
        total += shard[name].numel()
        if size >= shard_bytes:
            flush()
    flush()
    count = n
    for k, f in index.items():  # model-00001-of-0000N names, as transformers writes them
        index[k] = f.replace(".safetensors", f"-of-{count:05d}.safetensors")
    for f in sorted(tmp.glob("model-*.safetensors")):
        f.rename(tmp / f.name.replace(".safetensors", f"-of-{count:05d}.safetensors"))
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}, indent=1)
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return {"parameters": total, "shards": count, "config": cfg}


def measure(folder: Path, device: str, new_tokens: int) -> dict:
    """Next-token entropy and top-1 probability over the chat prompts' positions, and a greedy
    continuation's distinct-token share, with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    entropy, top1, distinct = [], [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)], device=device)
            logp = model(ids).logits[0].float().log_softmax(-1)
            entropy.append(float(-(logp.exp() * logp).sum(-1).mean()))
            top1.append(float(logp.max(-1).values.exp().mean()))
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1] :].tolist()
            distinct.append(len(set(out)) / max(1, len(out)))
    vocab = model.config.vocab_size
    return {
        "entropy_nats": round(sum(entropy) / len(entropy), 3),
        "flat_entropy_nats": round(math.log(vocab), 3),
        "top1_prob": round(sum(top1) / len(top1), 4),
        "greedy_distinct_share": round(sum(distinct) / len(distinct), 3),
        "greedy_tokens": new_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tokenizer", required=True, help="SmolLM2's tokenizer folder (the converted target's, or chunk1's)"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--measure-tokens", type=int, default=64, help="greedy continuation per prompt (0: no measure)")
    a = ap.parse_args()
    out = Path(a.out)
    t0 = time.monotonic()
    built = build(out, a.shape, Path(a.tokenizer), a.device, a.seed, a.shard_gb * 1e9)
    report = {"shape": a.shape, "seed": a.seed, "parameters": built["parameters"], "shards": built["shards"]}
    report["build_s"] = round(time.monotonic() - t0, 1)
    if a.measure_tokens:
        t0 = time.monotonic()
        report.update(measure(out, a.device, a.measure_tokens))
        report["measure_s"] = round(time.monotonic() - t0, 1)
    (out / "target.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
