"""An fp16 KV cache on specdec's GGUF kernel against its fp32 one: the cost, and the agreement.

The kernel keeps its keys and values in fp32. This builds the kernel a second time with
``-DGG_KV_F16`` (keys and values rounded to the nearest fp16 as they are stored and read back
exactly, everything else as before) and compares the two on one model, in one process:

- speed: a one-token step and a verification pass of ``--rows`` rows after ``--contexts`` cached
  positions (the cache filled with random keys and values: attention reads every cached key
  whatever it holds), the two builds alternating, the fastest of ``--repeats`` each; and the
  attention alone (``gguf_attention``, one layer's, the model's heads), timed the same way;
- batch invariance of the fp16 build: a pass of ``--rows`` rows against one-token steps, bit for bit;
- agreement: for each prompt, the fp32 build's greedy continuation of ``--new-tokens`` tokens
  against the fp16 build's (equal or not, where they part), and the largest difference between
  the two builds' logits over the fp32 continuation fed to both (the same tokens).

    python benchmarks/kv_cache_f16.py --model qwen2.5-coder-1.5b --threads 2 --out benchmarks/kv-cache-f16.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

PROMPTS = [
    "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n",
    "The three most important ideas in the theory of computation are",
    "import json\n\n\ndef load_config(path):\n",
]


def ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",")]
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a pack name or a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", type=ints, default=[512, 8192, 32000], help="cached positions before the timed passes")
    parser.add_argument("--rows", type=int, default=4, help="rows of the timed verification pass")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--long-prompt", type=Path, default=Path(__file__).resolve().parents[1] / "src/specdec/engine.py",
                        help="a text file whose first --long-tokens tokens make one more prompt")
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--parts", default="speed,attention,agreement", help="which measurements to make")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    import torch

    from specdec import packs
    from specdec.backends import gguf
    from specdec.models import load_tokenizer, locate

    path = packs.gguf_file(args.model, progress=False) if args.model in packs.PACKS else Path(args.model)
    tokenizer = load_tokenizer(locate(args.model))
    longest = max(max(args.contexts) + args.rows, args.long_tokens + args.new_tokens + 1)
    w = gguf.GGUFWeights(path, n_ctx=longest)
    fp32 = gguf.GGUFCausalLM(w, n_threads=args.threads)
    fp16 = gguf.GGUFCausalLM(w, n_threads=args.threads)
    fp16.lib = gguf.library("kv-f16")  # the same paths, fp16 keys and values
    fp16._cache = torch.empty(fp32._cache.shape, dtype=torch.float16)
    models = {"fp32": fp32, "fp16": fp16}
    print(f"{w.description}: {fp32.cache_bytes / 2**20:.0f} MiB of fp32 cache for {w.capacity} positions, "
          f"{fp16.cache_bytes / 2**20:.0f} MiB in fp16; path {gguf.kernel_path(fp32.lib)}", file=sys.stderr)

    # batch invariance of the fp16 build: rows of a pass against one-token steps
    ids = [(17 + 7919 * i) % w.vocab_size for i in range(40)]
    fp16.reset()
    fp16.forward(ids[:30])
    together = fp16.forward(ids[30 : 30 + args.rows])
    fp16.trim(30)
    alone = torch.cat([fp16.forward([t]) for t in ids[30 : 30 + args.rows]])
    invariant = bool(torch.equal(together, alone))
    print(f"fp16 build: a pass of {args.rows} rows equals one-token steps bit for bit: {invariant}", file=sys.stderr)

    # speed: a step and a verification pass after `context` random cached positions
    gen = torch.Generator().manual_seed(0)
    timings, attention = [], []
    for context in args.contexts if "attention" in parts else []:
        import ctypes

        q = torch.randn(w.heads, args.rows, w.head_dim, generator=gen)
        out = torch.empty(args.rows, w.heads, w.head_dim)
        keys = torch.randn(2, w.kv_heads, context + args.rows, w.head_dim, generator=gen)
        caches = {"fp32": keys, "fp16": keys.half()}
        qpos = torch.arange(context, context + args.rows)
        kpos = torch.arange(context + args.rows)
        best = {name: {} for name in models}
        for sweep in range(4 * args.repeats + 1):
            for name in (list(models) if sweep % 2 else list(models)[::-1]):
                lib, kv = models[name].lib, caches[name]
                for rows in (1, args.rows):
                    t0 = time.perf_counter()
                    rc = lib.gguf_attention(q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), None, out.data_ptr(),
                                            w.heads, w.kv_heads, rows, context + rows, w.head_dim, context + args.rows,
                                            ctypes.c_float(w.attn_scale), qpos.data_ptr(), kpos.data_ptr(), 0, args.threads)
                    seconds = time.perf_counter() - t0
                    assert rc == 0
                    if sweep:
                        best[name][rows] = min(best[name].get(rows, float("inf")), seconds)
        row = {"context": context, "layers": w.n_layers,
               **{f"{name}_ms_one_layer": {str(r): round(s * 1000, 3) for r, s in b.items()} for name, b in best.items()}}
        attention.append(row)
        print(json.dumps(row), file=sys.stderr)
    for context in args.contexts if "speed" in parts else []:
        for name, model in models.items():
            model.reset()
            fill = torch.randn((w.n_layers, 2, w.kv_heads, context, w.head_dim), generator=gen)
            model._cache[:, :, :, :context] = fill.to(model._cache.dtype)
            model._pos[:context] = torch.arange(context)
            model._length, model._tokens = context, [0] * context
        best: dict[str, dict[int, float]] = {name: {} for name in models}
        for sweep in range(args.repeats + 1):  # the first: a warm-up
            order = list(models.items()) if sweep % 2 else list(models.items())[::-1]
            for rows in (1, args.rows):
                for name, model in order:
                    t0 = time.perf_counter()
                    model.forward(ids[:rows])
                    seconds = time.perf_counter() - t0
                    model.trim(context)
                    if sweep:
                        best[name][rows] = min(best[name].get(rows, float("inf")), seconds)
        row = {"context": context, **{f"{name}_ms": {str(r): round(s * 1000, 1) for r, s in b.items()} for name, b in best.items()}}
        timings.append(row)
        print(json.dumps(row), file=sys.stderr)

    # agreement: greedy continuations and logits over the same tokens
    texts = list(PROMPTS) if "agreement" in parts else []
    if args.long_prompt.is_file() and "agreement" in parts:
        long_ids = tokenizer(args.long_prompt.read_text(), add_special_tokens=True)["input_ids"][: args.long_tokens]
        texts.append(long_ids)
    agreement = []
    for prompt in texts:
        prompt_ids = prompt if isinstance(prompt, list) else tokenizer(prompt, add_special_tokens=True)["input_ids"]
        outs, logits = {}, {}
        for name, model in models.items():
            model.reset()
            last = model.forward(prompt_ids, num_logits=1)[-1]
            out = []
            for _ in range(args.new_tokens):
                out.append(int(last.argmax()))
                last = model.forward([out[-1]])[-1]
            outs[name] = out
        for name, model in models.items():  # the fp32 continuation through both: the same inputs
            model.reset()
            logits[name] = model.forward(prompt_ids + outs["fp32"][:-1], num_logits=len(outs["fp32"]))
        diff = (logits["fp32"] - logits["fp16"]).abs()
        top2 = logits["fp32"].topk(2, dim=-1).values
        parted = next((i for i, (a, b) in enumerate(zip(outs["fp32"], outs["fp16"])) if a != b), None)
        item = {"prompt_tokens": len(prompt_ids), "greedy_equal": outs["fp32"] == outs["fp16"], "parted_at": parted,
                "max_logit_diff": round(float(diff.max()), 5), "mean_logit_diff": round(float(diff.mean()), 6),
                "smallest_top2_margin": round(float((top2[:, 0] - top2[:, 1]).min()), 5),
                "argmax_equal_rows": int((logits["fp32"].argmax(-1) == logits["fp16"].argmax(-1)).sum()),
                "rows": len(outs["fp32"])}
        if parted is not None:
            item["margin_where_parted"] = round(float(top2[parted, 0] - top2[parted, 1]), 5)
        agreement.append(item)
        print(json.dumps(item), file=sys.stderr)

    result = {"model": str(args.model), "description": w.description, "threads": args.threads, "path": gguf.kernel_path(fp32.lib),
              "machine": platform.processor() or platform.machine(), "cache_mib": {"fp32": fp32.cache_bytes / 2**20,
              "fp16": fp16.cache_bytes / 2**20, "positions": w.capacity}, "fp16_batch_invariant": invariant,
              "timings": timings, "attention": attention,
              "agreement": agreement}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
