"""What an extra row costs specdec's GGUF kernel when memory is not the limit: its arithmetic floor.

A pass of n rows reads each weight block once and applies it to every row, so its extra rows cost
arithmetic only. This times the kernel's matrix product (:func:`specdec.backends.gguf.matmul`) for
n = 1, 2, 4, 8, 16 rows on random Q4_K and Q6_K weights (in the layout a loaded model keeps) of two sizes: one that stays in the last-
level cache (the arithmetic alone) and one far larger than it (streamed from memory, as a model's
weights are). The extra time per row per weight, times the weights a model multiplies per token,
is the least an extra verification row can cost that model on this CPU with this instruction set,
whatever the memory does. Prints a table and writes JSON.

    python benchmarks/gguf_compute_floor.py --threads 2 [--model PACK_OR_GGUF] [--out FILE]

``--model`` (default: the default target) supplies the weight count to project onto, and the file
whose one-token step the JSON's ``machine`` records (:func:`specdec.bench.machine.machine_record`:
the CPU's vector features, the memory's read speed, each GGUF backend's one-token step), measured
first. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from specdec import packs
from specdec.backends import gguf as native
from specdec.bench.machine import READ_MIB, machine_record

N_IN = 1536  # the default target's hidden size
SIZES_MIB = {"cache-resident": 8, "streamed": 512}  # weights of each size, MiB
ROWS = (1, 2, 4, 8, 16)
TYPES = {"Q4_K": T.Q4_K, "Q6_K": T.Q6_K}


def random_weight(qtype: T, n_out: int, rng: np.random.Generator) -> np.ndarray:
    """[n_out, row bytes] uint8 of valid blocks: random quants, small positive f16 scales."""
    row = native.row_bytes(int(qtype), N_IN)
    w = rng.integers(0, 256, size=(n_out, row), dtype=np.uint8)
    block = {T.Q4_K: 144, T.Q6_K: 210}[qtype]
    blocks = w.reshape(n_out, -1, block)
    scale = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    if qtype == T.Q4_K:  # d and dmin lead the block
        blocks[:, :, 0:2] = scale
        blocks[:, :, 2:4] = scale
    else:  # d ends the block
        blocks[:, :, block - 2:block] = scale
    return np.ascontiguousarray(w)


def loaded(weight: np.ndarray, qtype: T) -> tuple[np.ndarray, int]:
    """The tensor as a loaded model multiplies it: (bytes, type id), repacked eight rows at a time
    where the type has that layout (:func:`specdec.backends.gguf.repack`)."""
    packed = native.repack(weight, int(qtype), N_IN)
    return (weight, int(qtype)) if packed is None else packed


def time_rows(weight: np.ndarray, qtype: T, threads: int, seconds: float) -> dict[int, float]:
    """Fastest seconds of a product with n rows, for each n in ROWS (sweeps over n until ``seconds``),
    on the layout a loaded model multiplies."""
    n_out = weight.shape[0]
    weight, type_id = loaded(weight, qtype)
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(n, N_IN, generator=gen) for n in ROWS}
    best = {n: float("inf") for n in ROWS}
    for n in ROWS:  # warm-up
        native.matmul(weight, type_id, N_IN, xs[n], threads=threads, n_out=n_out)
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for n in ROWS:
            t0 = time.perf_counter()
            native.matmul(weight, type_id, N_IN, xs[n], threads=threads, n_out=n_out)
            best[n] = min(best[n], time.perf_counter() - t0)
    return best


def model_file(model: str) -> Path:
    return packs.gguf_file(model, progress=False) if model in packs.PACKS else Path(model).expanduser()


def model_weights(path: Path) -> int:
    """Weights a token's forward multiplies: every 2-D tensor but the embedding, plus the head
    (the embedding again where the model ties them)."""
    w = native.GGUFWeights(path)
    names = {t.name: int(np.prod(t.shape)) for t in w.reader.tensors if len(t.shape) > 1}
    layers = sum(v for k, v in names.items() if k.startswith("blk."))
    return layers + names.get("output.weight", names["token_embd.weight"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="timing per type and size")
    parser.add_argument("--model", default=packs.DEFAULT_TARGET, help="a pack or .gguf: the weight count projected onto")
    parser.add_argument("--out", default=None, help="JSON file (default: gguf-compute-floor.json beside this script)")
    parser.add_argument("--resident-mib", type=int, default=SIZES_MIB["cache-resident"],
                        help="MiB of weights that stay in the last-level cache")
    parser.add_argument("--streamed-mib", type=int, default=SIZES_MIB["streamed"],
                        help="MiB of weights far larger than the cache")
    parser.add_argument("--read-mib", type=int, default=READ_MIB, help="MiB read to measure the memory's read speed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    path = model_file(args.model)
    per_token = model_weights(path)
    machine = machine_record(args.threads, path, read_mib=args.read_mib)
    results: dict = {"threads": args.threads, "n_in": N_IN, "machine": machine,
                     "sizes_mib": {"cache-resident": args.resident_mib, "streamed": args.streamed_mib},
                     "kernel_path": native.kernel_path(), "model": args.model,
                     "model_weights_per_token": per_token, "ms": {}, "extra_row_ms_projected": {}}
    print(f"| type | weights | n_out | " + " | ".join(f"{n} rows (ms)" for n in ROWS) + " | extra row, ns per 1k weights |")
    print("|---|---|---:|" + "---:|" * len(ROWS) + "---:|")
    for name, qtype in TYPES.items():
        for size_name, mib in (("cache-resident", args.resident_mib), ("streamed", args.streamed_mib)):
            n_out = max(1, (mib << 20) // native.row_bytes(int(qtype), N_IN))
            best = time_rows(random_weight(qtype, n_out, rng), qtype, args.threads, args.seconds)
            extra = (best[ROWS[-1]] - best[1]) / (ROWS[-1] - 1)  # seconds per extra row
            per_weight = extra / (n_out * N_IN)
            results["ms"].setdefault(name, {})[size_name] = {str(n): 1e3 * t for n, t in best.items()}
            results["extra_row_ms_projected"].setdefault(name, {})[size_name] = 1e3 * per_weight * per_token
            print(f"| {name} | {size_name} | {n_out} | " + " | ".join(f"{1e3 * best[n]:.2f}" for n in ROWS)
                  + f" | {1e12 * per_weight:.1f} |")
    print(f"\nprojected extra-row cost for {args.model} ({per_token / 1e9:.2f}G weights per token), ms:")
    for name, sizes in results["extra_row_ms_projected"].items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in sizes.items()))
    out = Path(args.out) if args.out else Path(__file__).with_name("gguf-compute-floor.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
