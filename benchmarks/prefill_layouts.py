"""What a forward of n new rows costs in llama.cpp on each weight layout of one GGUF file.

llama.cpp repacks some quantised weights at load for its wide CPU kernels; the llama.cpp backend
decodes on that copy and, where it measures faster, prefills long chains on the layout as stored in
the file (:func:`specdec.backends.llamacpp.choose_prefill_layout`). This times, for each n, a pass
of n new rows (logits for the last row, as a prefill asks) on two contexts of the same file, one
per layout, alternating which goes first; each from an empty cache; the fastest of --repeats.
Prints a Markdown table and writes prefill-layouts.json beside this file, or --out.

    python benchmarks/prefill_layouts.py [--model qwen2.5-coder-1.5b] [--threads 2] [--repeats 3] [--rows 1,4,16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdec import packs

ROWS = (1, 4, 16, 32, 64, 128, 256, 512)


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def row_counts(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(positive(v) for v in text.split(","))
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"takes positive integers separated by commas, e.g. 1,4,16; got {text!r}") from None
    if max(rows) > 1024 - 64:
        raise argparse.ArgumentTypeError(f"at most {1024 - 64} rows fit the 1024-token context, got {max(rows)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a pack name or a .gguf file")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--repeats", type=positive, default=3)
    parser.add_argument("--rows", type=row_counts, default=ROWS,
                        help=f"pass sizes, comma-separated (default: {','.join(map(str, ROWS))})")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: prefill-layouts.json beside this script)")
    args = parser.parse_args()
    rows = args.rows
    if args.model in packs.PACKS:
        path = packs.gguf_file(args.model, progress=False)
    elif Path(args.model).suffix.lower() == ".gguf" and Path(args.model).is_file():
        path = Path(args.model)
    else:
        parser.error(f"--model: {args.model} is neither a pack ({', '.join(packs.PACKS)}) nor a .gguf file")
    from specdec.backends import llamacpp  # only now: --help and a wrong argument answer at once

    contexts = {
        layout: llamacpp.LlamaCppCausalLM(llamacpp.GGUFWeights(path, repack=layout == "repacked"),
                                          n_threads=args.threads, n_ctx=1024)
        for layout in ("repacked", "file")
    }
    vocab = contexts["file"].vocab_size
    ids = [(17 + 7919 * i) % vocab for i in range(max(rows))]
    for model in contexts.values():  # warm-up: page the weights in
        model.forward(ids[:64], num_logits=1)
        model.reset()
    seconds: dict[int, dict[str, float]] = {}
    for n in rows:
        times: dict[str, list[float]] = {layout: [] for layout in contexts}
        for repeat in range(args.repeats):
            order = list(contexts.items()) if repeat % 2 == 0 else list(contexts.items())[::-1]
            for layout, model in order:
                t0 = time.perf_counter()
                model.forward(ids[:n], num_logits=1)
                times[layout].append(time.perf_counter() - t0)
                model.reset()
        seconds[n] = {layout: min(t) for layout, t in times.items()}
    lines = ["| n rows | " + " | ".join(str(n) for n in rows) + " |", "|---|" + "---:|" * len(rows)]
    lines.append("| repacked (ms) | " + " | ".join(f"{1000 * seconds[n]['repacked']:.0f}" for n in rows) + " |")
    lines.append("| as stored in the file (ms) | " + " | ".join(f"{1000 * seconds[n]['file']:.0f}" for n in rows) + " |")
    lines.append("| stored / repacked | "
                 + " | ".join(f"{seconds[n]['file'] / seconds[n]['repacked']:.2f}" for n in rows) + " |")
    print("\n".join(lines))
    out = args.out or Path(__file__).with_name("prefill-layouts.json")
    out.write_text(json.dumps({"model": args.model, "file": path.name, "threads": args.threads,
                               "repeats": args.repeats, "seconds": {str(n): v for n, v in seconds.items()}}, indent=1))
    print(f"\n(written to {out})")


if __name__ == "__main__":
    main()
