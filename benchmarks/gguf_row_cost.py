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
times specdec's backend alone.

    python benchmarks/gguf_row_cost.py --types Q5_K,Q3_K,Q2_K --threads 2 [--shape 8960x1536]

times the kernel alone on one tensor of each type (random valid blocks; default shape: the default
target's ffn_gate, its largest matrix in the layers, in copies taken in turn that overflow the
last-level cache): passes of n rows, the fastest of the repeats, beside the memory floor (the
tensor's bytes at the machine's read speed). No file is needed. The JSON's ``machine`` is the machine the figures were measured on
(:func:`specdec.bench.machine.machine_record`: the CPU's vector features, the memory's read speed,
each backend's one-token step), measured first. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
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
    parser.add_argument("--types", default=None, help="time the kernel on one tensor of each of these ggml types")
    parser.add_argument("--shape", default="8960x1536", help="the tensor of --types: outputs x inputs")
    args = parser.parse_args()
    if args.types:
        type_costs(args)
        return
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


COPIES_BYTES = 256 << 20  # --types: the copies of a tensor taken in turn, far more than a last-level cache


def random_tensor(qtype: int, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes with finite fp16 scales (every fp16 field of a block; the kernel's cost does not
    depend on the values): [n_out, row bytes] uint8."""
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    block, size = quants.GGML_QUANT_SIZES[T(qtype)]
    raw = rng.integers(0, 256, size=(n_out, n_in // block, size), dtype=np.uint8)
    scales = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,), T.IQ4_NL: (0,),
              T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}
    for at in scales.get(T(qtype), ()):
        values = rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_out, -1)


def type_costs(args: argparse.Namespace) -> None:
    """--types: each type's tensor against passes of n rows, the fastest of the repeats, in ms."""
    from gguf import GGMLQuantizationType as T

    from specdec.bench.machine import read_speed

    n_out, n_in = (int(v) for v in args.shape.split("x"))
    sizes = sorted({1, *(int(v) for v in args.rows.split(","))})
    gb_per_s = read_speed(args.threads, mib=args.read_mib)["gb_per_s"]
    rng = np.random.default_rng(0)
    lines = ["| type | MB | floor ms | " + " | ".join(f"{n} rows ms" for n in sizes) + " | × floor (1 row) |",
             "|---" * (4 + len(sizes)) + "|"]
    results = {}
    for name in args.types.split(","):
        qtype = int(T[name.strip()])
        # copies of the tensor, more than the last-level cache holds, taken in turn: each pass
        # reads its weights from memory, as a model's layers do
        first = random_tensor(qtype, n_out, n_in, rng)
        weights = [first] + [np.roll(first, k, axis=0) for k in range(1, -(-COPIES_BYTES // first.nbytes))]
        weight = first
        floor = weight.nbytes / gb_per_s / 1e6
        x = torch.randn(max(sizes), n_in, generator=torch.Generator().manual_seed(0))
        for w in weights:
            native.matmul(w, qtype, n_in, x[:1], threads=args.threads)  # a warm-up: pages mapped
        best = {}
        for n in sizes:
            times = []
            for _ in range(args.repeats):
                for w in weights:
                    t0 = time.perf_counter()
                    native.matmul(w, qtype, n_in, x[:n], threads=args.threads)
                    times.append(time.perf_counter() - t0)
            best[n] = min(times) * 1000
        results[name] = {"bytes": weight.nbytes, "floor_ms": floor, "min_ms": best}
        lines.append(f"| {name} | {weight.nbytes / 1e6:.1f} | {floor:.2f} | " + " | ".join(f"{best[n]:.2f}" for n in sizes)
                     + f" | {best[1] / floor:.2f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out) if args.out else Path(__file__).with_name("gguf-type-cost.json")
    out.write_text(json.dumps({
        "shape": [n_out, n_in], "threads": args.threads, "repeats": args.repeats, "read_gb_per_s": gb_per_s,
        "kernel_path": native.kernel_path(), "types": results, "table": table,
        "command": f"python benchmarks/gguf_row_cost.py --types {args.types} --shape {args.shape} "
                   f"--threads {args.threads} --repeats {args.repeats} --rows {args.rows}",
    }, indent=1))


if __name__ == "__main__":
    main()
