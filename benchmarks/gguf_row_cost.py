"""Cost of a cached forward pass of n rows on a GGUF file: specdec's GGUF backend
(:mod:`specdec.backends.gguf`) against llama.cpp (:func:`specdec.backends.llamacpp.load_gguf`).

Both backends load the same file, prefill the same context, and then, for each repeat and each n,
run an n-token pass (logits for every row, as verification asks) and roll it back, the two backends
back to back, so that machine drift falls on both. Prints a Markdown table of median milliseconds
and of each backend's cost relative to its own one-row pass (``--stat min``: the fastest repeat,
which other work on a shared machine can only slow down), and writes JSON with both.

    python benchmarks/gguf_row_cost.py --model PATH_OR_PACK --threads 2 [--repeats 5] [--out FILE]

``--model`` takes a .gguf file or a pack name (default: the default target,
qwen2.5-coder-1.5b, whose joined GGUF is prepared in the cache on first use). ``--no-llamacpp``
times specdec's backend alone. The JSON's ``machine`` is the machine the figures were measured on
(:func:`specdec.bench.machine.machine_record`: the CPU's vector features, the memory's read speed,
each backend's one-token step), measured first. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdec import packs
from specdec.backends import gguf as native
from specdec.bench.machine import READ_MIB, machine_record


def resolve(model: str) -> Path:
    if model in packs.PACKS:
        return packs.gguf_file(model, progress=False)
    return Path(model).expanduser()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=packs.DEFAULT_TARGET, help="a .gguf file or a pack name")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=100, help="tokens cached before the timed passes")
    parser.add_argument("--rows", default="1,2,4,8,16", help="pass sizes, comma-separated")
    parser.add_argument("--out", default=None, help="JSON file (default: gguf-row-cost.json beside this script)")
    parser.add_argument("--no-llamacpp", action="store_true", help="time specdec's backend only")
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="what the table shows")
    parser.add_argument("--read-mib", type=int, default=READ_MIB, help="MiB read to measure the memory's read speed")
    args = parser.parse_args()
    path = resolve(args.model)
    sizes = sorted({1, *(int(v) for v in args.rows.split(","))})  # ratios are to the one-row pass
    torch.set_num_threads(args.threads)
    machine = machine_record(args.threads, path, read_mib=args.read_mib)

    backends = {"specdec": native.load_gguf_native(path, n_threads=args.threads, n_ctx=1024)}
    if not args.no_llamacpp:
        from specdec.backends import llamacpp

        backends["llama.cpp"] = llamacpp.load_gguf(path, n_threads=args.threads, n_ctx=1024, prefill_layout="repacked")
    vocab = min(b.vocab_size for b in backends.values())
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(100, min(20000, vocab), (args.context,), generator=gen).tolist()
    for backend in backends.values():
        backend.forward(context, num_logits=1)
        backend.forward(context[:1])  # a warm-up step (pages mapped, threads started)
        backend.trim(args.context)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in backends}
    for _ in range(args.repeats):
        for n in sizes:
            new = torch.randint(100, min(20000, vocab), (n,), generator=gen).tolist()
            for name, backend in backends.items():
                t0 = time.perf_counter()
                backend.forward(new)  # logits for every row, as a verification pass
                times[name][n].append(time.perf_counter() - t0)
                backend.trim(args.context)
    medians = {name: {n: statistics.median(v) * 1000 for n, v in d.items()} for name, d in times.items()}
    minima = {name: {n: min(v) * 1000 for n, v in d.items()} for name, d in times.items()}
    med = medians if args.stat == "median" else minima
    names = list(backends)
    header = "| rows | " + " | ".join(f"{name} ({args.stat} ms) | × its 1-row" for name in names) + " |"
    lines = [header, "|---" * (1 + 2 * len(names)) + "|"]
    for n in sizes:
        cells = " | ".join(f"{med[name][n]:.1f} | {med[name][n] / med[name][1]:.2f}" for name in names)
        lines.append(f"| {n} | {cells} |")
    table = "\n".join(lines)
    print(table)
    if "llama.cpp" in med:
        print(f"specdec one-row pass / llama.cpp's: {med['specdec'][1] / med['llama.cpp'][1]:.2f}")
    out = Path(args.out) if args.out else Path(__file__).with_name("gguf-row-cost.json")
    out.write_text(json.dumps({
        "model": str(path), "threads": args.threads, "repeats": args.repeats, "context": args.context,
        "median_ms": medians, "min_ms": minima, "table_stat": args.stat,
        "ratio_to_one_row": {k: {n: v[n] / v[1] for n in v} for k, v in med.items()},
        "kernel_path": native.kernel_path(), "machine": machine,
        "command": f"python benchmarks/gguf_row_cost.py --model {args.model} --threads {args.threads} "
                   f"--repeats {args.repeats} --stat {args.stat}",
        "table": table,
    }, indent=1))


if __name__ == "__main__":
    main()
