"""What a draft token costs on specdec's GGUF kernel, part by part, against a target step.

For the target's one-token step and each draft (the draft's file as it is, its head trimmed to
``--draft-vocab`` ids, its layers requantized to Q4_0 (``specdec.requantize``), and both), one-token
cached steps after a 200-token context, every model in turn in each round (interleaved, so drift
falls on all), and per token:

- ``layers``: the kernel's pass through the layers (``gguf_forward_seqs``, timed around the call);
- ``head``: the output head (full or trimmed), timed on its own on the same normed row;
- ``rest``: the rest of the forward (the embedding lookup, the final norm, Python and torch around
  the calls): the step's time less the two;
- ``chain greedy`` / ``chain T=1``: what drafting adds per token beyond the forward
  (``ModelDrafter.propose`` of 4 tokens with a ``keep_going`` that reads the draft's confidence,
  as the planner's does: the sampling law q, the draw, the softmax for the confidence).

Beside them, each model's bytes read per token (its layers' tensors and its head's rows) over the
memory read speed measured here: the floor a memory-bound pass cannot go below. Medians over
``--rounds`` rounds of the per-round medians of ``--steps`` steps.

    python benchmarks/draft_token_parts.py --rounds 9 --out benchmarks/draft-token-parts.json

Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

CONTEXT = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="default: the default target")
    parser.add_argument("--draft", default=None, help="default: the default draft")
    parser.add_argument("--draft-vocab", type=int, default=None, help="ids a trimmed head scores (default: DRAFT_VOCAB)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("draft-token-parts.json"))
    args = parser.parse_args()
    import torch

    from specdec.memory import keep_freed_memory

    from specdec import models
    from specdec.backends.gguf import kernel_path
    from specdec.bench.machine import machine_record, read_speed
    from specdec.drafters.model import ModelDrafter
    from specdec.sampling import SamplingConfig

    target_name = args.target or models.DEFAULT_TARGET
    draft_name = args.draft or models.DEFAULT_DRAFT
    size = args.draft_vocab or models.DRAFT_VOCAB
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the specdec command does: vocabulary-sized tensors every step (specdec.memory)
    pair = models.load_pair(target_name, draft_name, backend="gguf", n_threads=args.threads, n_ctx=1024)
    target, tokenizer = pair.target, pair.tokenizer
    eos = target.generation_config.eos_token_id
    located = models.requantized_draft(models.locate(draft_name, backend="gguf"), draft_name, "q4_0", "gguf",
                                       target_name)
    q4 = models.load_model(located, "gguf", n_threads=args.threads, n_ctx=1024)
    trimmed, kept = models.trim_draft(pair.draft.fork(), tokenizer, size, "gguf", eos_ids=eos)
    q4_trimmed, _ = models.trim_draft(q4.fork(), tokenizer, size, "gguf", eos_ids=eos)
    drafts = {"draft": pair.draft, f"draft, head {kept}": trimmed, "draft, Q4_0 layers": q4,
              f"draft, Q4_0 layers, head {kept}": q4_trimmed}
    timed = {"target": target, **drafts}

    spent = [0.0]  # seconds inside gguf_forward_seqs since the last reset
    for model in timed.values():
        lib = model.lib
        if not hasattr(lib, "_timed"):
            real = lib.gguf_forward_seqs

            def wrapped(*a, _real=real):
                t0 = time.perf_counter()
                try:
                    return _real(*a)
                finally:
                    spent[0] += time.perf_counter() - t0

            lib.gguf_forward_seqs, lib._timed = wrapped, True

    context = torch.randint(100, 20000, (CONTEXT,), generator=torch.Generator().manual_seed(0)).tolist()
    for model in timed.values():
        model.reset()
        model.forward(context, 1)
    normed = torch.randn(1, target.weights.hidden)

    def step(model) -> tuple[float, float]:
        times, inside = [], []
        for i in range(args.steps):
            model.trim(CONTEXT)
            spent[0] = 0.0
            t0 = time.perf_counter()
            model.forward([1000 + i], 1)
            times.append(time.perf_counter() - t0)
            inside.append(spent[0])
        model.trim(CONTEXT)
        return statistics.median(times), statistics.median(inside)

    def head(model) -> float:
        w = model.weights
        x = normed[:, : w.hidden].contiguous()
        out = torch.empty(1, w.vocab_size)
        t0 = time.perf_counter()
        if model.head is None:
            w.head(model.lib, x, out, 1, False, model.n_threads)
        else:
            model.head(model.lib, x, out, 1, model.n_threads)
        return time.perf_counter() - t0

    def chain(model, sampling, k: int = 4) -> float:
        drafter, generator = ModelDrafter(model), torch.Generator().manual_seed(0)
        model.trim(CONTEXT)
        t0 = time.perf_counter()
        drafter.propose(context, k, sampling, generator, keep_going=lambda confidence: float(confidence.max()) >= 0.0)
        seconds = time.perf_counter() - t0
        model.trim(CONTEXT)
        return seconds / k

    greedy, t1 = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in timed}
    for _ in range(args.rounds):
        for name, model in timed.items():
            whole, inside = step(model)
            mine = samples[name]
            mine.setdefault("step", []).append(whole)
            mine.setdefault("layers", []).append(inside)
            mine.setdefault("head", []).append(statistics.median(head(model) for _ in range(args.steps)))
            if name != "target":
                mine.setdefault("chain greedy", []).append(statistics.median(chain(model, greedy) for _ in range(2)))
                mine.setdefault("chain T=1", []).append(statistics.median(chain(model, t1) for _ in range(2)))
    speed = read_speed(args.threads)
    gb_per_s = speed["gb_per_s"]

    def bytes_read(model) -> dict[str, int]:
        w = model.weights
        layers = sum(int(t.n_bytes) for t in w.reader.tensors if t.name.startswith("blk."))
        rows = model.head.rows.tensors[0] if model.head is not None else w.head.tensors[0]
        return {"layers": layers, "head": int(rows.data.nbytes)}

    ms = {name: {part: round(1000 * statistics.median(v), 3) for part, v in parts.items()} for name, parts in samples.items()}
    one = ms["target"]["step"]
    report: dict = {"target": target_name, "draft": draft_name, "threads": args.threads, "context": CONTEXT,
                    "kernel_path": kernel_path(target.lib), "machine": machine_record(args.threads, None,
                                                                                      why_no_target="measured here"),
                    "memory_read": speed, "load_average_at_start": list(os.getloadavg()), "rounds": args.rounds,
                    "steps": args.steps, "ms": {}, "bytes": {}, "floor_ms": {}, "over_target_step": {}}
    for name, model in timed.items():
        parts = ms[name]
        parts["rest"] = round(parts["step"] - parts["layers"] - parts["head"], 3)
        for kind in ("chain greedy", "chain T=1"):
            if kind in parts:
                parts[kind + " beyond the step"] = round(parts[kind] - parts["step"], 3)
        report["ms"][name] = parts
        read = bytes_read(model)
        report["bytes"][name] = read
        report["floor_ms"][name] = {part: round(b / gb_per_s / 1e6, 3) for part, b in read.items()}
        report["over_target_step"][name] = {part: round(parts[part] / one, 3) for part in
                                            ("step", "layers", "head", "rest", "chain greedy", "chain T=1") if part in parts}
    report["command"] = ("python benchmarks/draft_token_parts.py" + f" --threads {args.threads} --rounds {args.rounds}"
                         f" --steps {args.steps} --out {args.out}")
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    header = "| model | step ms | layers | head | rest | chain greedy | chain T=1 | x target step (greedy chain) | floor: layers + head ms |"
    print(header + "\n|---|" + "---:|" * 8)
    for name, parts in ms.items():
        floor = report["floor_ms"][name]
        print(f"| {name} | {parts['step']:.2f} | {parts['layers']:.2f} | {parts['head']:.2f} | {parts['rest']:.2f} | "
              f"{parts.get('chain greedy', float('nan')):.2f} | {parts.get('chain T=1', float('nan')):.2f} | "
              f"{parts.get('chain greedy', parts['step']) / one:.3f} | {floor['layers']:.2f} + {floor['head']:.2f} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
