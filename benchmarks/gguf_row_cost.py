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
tensor's bytes at the machine's read speed). No file is needed.

    python benchmarks/gguf_row_cost.py --models Q4_0,Q5_K,qwen3,gemma3 --threads 2 [--repeats 5]

writes a random model for each name and times both backends on it as above: a block type gives a
qwen2 model of the default target's layer shapes (four layers) whose matrices are all of that type;
an architecture (:data:`SHAPES`) a model of a common shape of that family, Q4_K. The JSON's ``machine`` is the machine the figures were measured on
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
    parser.add_argument("--models", default=None,
                        help="time both backends on random models written for the purpose: block types "
                             "(a llama model of the default target's layer shapes, every matrix of that type) "
                             "and architectures (a model of a common shape of that family, Q4_K), comma-separated")
    args = parser.parse_args()
    if args.types:
        type_costs(args)
        return
    if args.models:
        model_costs(args)
        return
    path = resolve(args.model)
    sizes = sorted({1, *(int(v) for v in args.rows.split(","))})  # ratios are to the one-row pass
    torch.set_num_threads(args.threads)
    machine = machine_record(args.threads, path, read_mib=args.read_mib)
    medians, minima = pass_times(path, args.threads, sizes, args.repeats, args.context, not args.no_llamacpp)
    med = medians if args.stat == "median" else minima
    names = list(med)
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


def pass_times(path: Path, threads: int, sizes: list[int], repeats: int, context_len: int,
               with_llamacpp: bool) -> tuple[dict[str, dict[int, float]], dict[str, dict[int, float]]]:
    """(medians, minima) in ms of an n-row pass after ``context_len`` cached tokens, per backend
    (``specdec``, ``llama.cpp``) and n: both backends hold the file in one process and take turns."""
    backends = {"specdec": native.load_gguf_native(path, n_threads=threads, n_ctx=1024)}
    if with_llamacpp:
        from specdec.backends import llamacpp

        backends["llama.cpp"] = llamacpp.load_gguf(path, n_threads=threads, n_ctx=1024, prefill_layout="repacked")
    vocab = min(b.vocab_size for b in backends.values())
    low, high = min(100, vocab // 2), min(20000, vocab)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(low, high, (context_len,), generator=gen).tolist()
    for backend in backends.values():
        backend.forward(context, num_logits=1)
        backend.forward(context[:1])  # a warm-up step (pages mapped, threads started)
        backend.trim(context_len)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in backends}
    for _ in range(repeats):
        for n in sizes:
            new = torch.randint(low, high, (n,), generator=gen).tolist()
            for name, backend in backends.items():
                t0 = time.perf_counter()
                backend.forward(new)  # logits for every row, as a verification pass
                times[name][n].append(time.perf_counter() - t0)
                backend.trim(context_len)
    medians = {name: {n: statistics.median(v) * 1000 for n, v in d.items()} for name, d in times.items()}
    minima = {name: {n: min(v) * 1000 for n, v in d.items()} for name, d in times.items()}
    return medians, minima


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
        kind = qtype
        if native.repack(first[:1], qtype, n_in) is not None:  # a 32-weight type: the layout a loaded model multiplies
            packed = [native.repack(w, qtype, n_in) for w in weights]
            weights, kind = [p[0] for p in packed], packed[0][1]
        for w in weights:
            native.matmul(w, kind, n_in, x[:1], threads=args.threads, n_out=n_out)  # a warm-up: pages mapped
        best = {}
        for n in sizes:
            times = []
            for _ in range(args.repeats):
                for w in weights:
                    t0 = time.perf_counter()
                    native.matmul(w, kind, n_in, x[:n], threads=args.threads, n_out=n_out)
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


# --models: the default target's layer shapes (Qwen2.5-1.5B) for the block types; for the
# architectures, a common model of each family: Qwen2.5-1.5B, Qwen3-1.7B, Gemma 3 1B, Phi-3-mini,
# Llama 3.2 1B. Four layers each (Gemma 3: six, five sliding-window layers and a global one).
SHAPES = {
    "qwen2": dict(hidden=1536, heads=12, kv_heads=2, head_dim=128, ffn=8960, layers=4),
    "qwen3": dict(hidden=2048, heads=16, kv_heads=8, head_dim=128, ffn=6144, layers=4),
    "gemma3": dict(hidden=1152, heads=4, kv_heads=1, head_dim=256, ffn=6912, layers=6),
    "phi3": dict(hidden=3072, heads=32, kv_heads=32, head_dim=96, ffn=8192, layers=4),
    "llama": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, layers=4),
}
# llama-quantize's type for a tensor whose rows are not a whole number of 256-weight blocks (Gemma 3
# 1B's 1152-wide rows)
FALLBACK = {"Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
VOCAB = 512  # a byte-level vocabulary (llama.cpp loads a file only with one): the head costs little


def write_random_model(path: Path, arch: str, qtype: int, rng: np.random.Generator) -> None:
    """A random ``arch`` model of SHAPES[arch] whose matrices are all of ggml type ``qtype`` (or its
    FALLBACK where a row is no whole number of its blocks; the embedding and the head Q8_0), as a
    GGUF file both engines load."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    c = SHAPES[arch]
    d = c["head_dim"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["layers"]); w.add_context_length(2048); w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"]); w.add_head_count(c["heads"]); w.add_head_count_kv(c["kv_heads"])
    w.add_key_length(d); w.add_value_length(d); w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6 if arch in ("gemma3", "qwen2", "qwen3") else 10000.0)
    if arch == "gemma3":
        w.add_sliding_window(512)
    tokens = list(bytes_to_unicode().values())
    tokens += [f"<t{i}>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default"); w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens)); w.add_token_merges(["Ġ t"]); w.add_eos_token_id(7)

    def mat(name: str, n_out: int, n_in: int, kind: int = qtype) -> None:
        if n_in % gguf.GGML_QUANT_SIZES[T(kind)][0]:  # llama.cpp's fallback for rows no whole super-block fits
            kind = int(T[FALLBACK[T(kind).name]])
        w.add_tensor(name, random_tensor(kind, n_out, n_in, rng), raw_dtype=T(kind))

    def vec(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", VOCAB, c["hidden"], int(T.Q8_0))
    if arch != "gemma3":
        mat("output.weight", VOCAB, c["hidden"], int(T.Q8_0))
    if arch == "llama":
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, d // 2).astype(np.float32))
    vec("output_norm.weight", c["hidden"])
    q, kv = c["heads"] * d, c["kv_heads"] * d
    for i in range(c["layers"]):
        vec(f"blk.{i}.attn_norm.weight", c["hidden"]); vec(f"blk.{i}.ffn_norm.weight", c["hidden"])
        if arch in ("qwen3", "gemma3"):
            vec(f"blk.{i}.attn_q_norm.weight", d); vec(f"blk.{i}.attn_k_norm.weight", d)
        if arch == "gemma3":
            vec(f"blk.{i}.post_attention_norm.weight", c["hidden"]); vec(f"blk.{i}.post_ffw_norm.weight", c["hidden"])
        if arch == "qwen2":
            for name, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.01 * rng.standard_normal(n)).astype(np.float32))
        if arch == "phi3":
            mat(f"blk.{i}.attn_qkv.weight", q + 2 * kv, c["hidden"])
            mat(f"blk.{i}.ffn_up.weight", 2 * c["ffn"], c["hidden"])
        else:
            mat(f"blk.{i}.attn_q.weight", q, c["hidden"]); mat(f"blk.{i}.attn_k.weight", kv, c["hidden"])
            mat(f"blk.{i}.attn_v.weight", kv, c["hidden"])
            mat(f"blk.{i}.ffn_gate.weight", c["ffn"], c["hidden"]); mat(f"blk.{i}.ffn_up.weight", c["ffn"], c["hidden"])
        mat(f"blk.{i}.attn_output.weight", c["hidden"], q)
        mat(f"blk.{i}.ffn_down.weight", c["hidden"], c["ffn"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def model_costs(args: argparse.Namespace) -> None:
    """--models: both backends on a random model of each named block type (a qwen2 model of the
    default target's shapes) or architecture; the
    fastest of the repeats (other work on a shared machine can only slow a pass down)."""
    import tempfile

    from gguf import GGMLQuantizationType as T

    sizes = sorted({1, *(int(v) for v in args.rows.split(","))})
    torch.set_num_threads(args.threads)
    machine = machine_record(args.threads, None, why_no_target="random models, one per row of the table",
                             read_mib=args.read_mib)
    rng = np.random.default_rng(0)
    results = {}
    head = " | ".join(f"{n}" for n in sizes[1:])
    lines = [f"| model | MB | specdec 1 row ms | specdec {head} rows × 1 row | llama.cpp 1 row ms | "
             f"llama.cpp {head} rows × 1 row | specdec / llama.cpp, 1 row |", "|---" * 7 + "|"]
    with tempfile.TemporaryDirectory() as folder:
        for name in (v.strip() for v in args.models.split(",")):
            arch, qtype = (name, int(T.Q4_K)) if name in SHAPES else ("qwen2", int(T[name]))
            path = Path(folder) / f"{name}.gguf"
            write_random_model(path, arch, qtype, rng)
            mb = path.stat().st_size / 1e6
            _, minima = pass_times(path, args.threads, sizes, args.repeats, args.context, True)
            path.unlink()
            ours, theirs = minima["specdec"], minima["llama.cpp"]
            shape = {"arch": arch, "type": T(qtype).name, **SHAPES[arch],
                     "fallback": FALLBACK.get(T(qtype).name) if SHAPES[arch]["hidden"] % 256 else None}
            results[name] = {"shape": shape, "file_mb": mb, "min_ms": minima}
            ratio = lambda m: " / ".join(f"{m[n] / m[1]:.2f}" for n in sizes[1:])  # noqa: E731
            lines.append(f"| {name} ({arch}, {T(qtype).name}) | {mb:.0f} | {ours[1]:.1f} | {ratio(ours)} | {theirs[1]:.1f} | "
                         f"{ratio(theirs)} | {ours[1] / theirs[1]:.2f} |")
            print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    out = Path(args.out) if args.out else Path(__file__).with_name("gguf-model-cost.json")
    out.write_text(json.dumps({
        "threads": args.threads, "repeats": args.repeats, "context": args.context, "rows": sizes,
        "kernel_path": native.kernel_path(), "machine": machine, "models": results, "table": table,
        "command": f"python benchmarks/gguf_row_cost.py --models {args.models} --threads {args.threads} "
                   f"--repeats {args.repeats} --rows {args.rows}",
    }, indent=1))


if __name__ == "__main__":
    main()
