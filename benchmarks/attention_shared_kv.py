"""The GGUF kernel's attention, one layer of the default target's shape, against an earlier build of
the kernel: each (query head, row) a job reading its kv head's whole cache, against jobs that read
each key and value once for the query heads that share it. Both builds alternate, the fastest of
``--repeats`` each, after ``--contexts`` cached positions, for a one-token step and a pass of
``--rows`` rows; the outputs must be equal bit for bit.

    python benchmarks/attention_shared_kv.py --before ~/.cache/specdec/kernels/linear_gguf-native-<hash>.so
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="an earlier build of linear_gguf.c (a .so in the kernels' cache)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="512,4096,32000")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()

    import torch

    from specdec.backends import gguf

    libs = {"before": ctypes.CDLL(args.before), "now": gguf.library()}
    gguf.declare(libs["before"])
    H, KV, d, rows = args.heads, args.kv_heads, args.head_dim, args.rows
    gen = torch.Generator().manual_seed(0)
    for context in [int(c) for c in args.contexts.split(",")]:
        q = torch.randn(H, rows, d, generator=gen)
        kv = torch.randn(2, KV, context + rows, d, generator=gen)
        qpos, kpos = torch.arange(context, context + rows), torch.arange(context + rows)
        best: dict[str, dict[int, float]] = {name: {} for name in libs}
        outs: dict[str, dict[int, torch.Tensor]] = {name: {} for name in libs}
        for sweep in range(args.repeats + 1):
            for name in (list(libs) if sweep % 2 else list(libs)[::-1]):
                for n in (1, rows):
                    out = torch.empty(n, H, d)
                    query = q[:, :n].contiguous()  # kept: a temporary's memory is freed (and written) before the call
                    t0 = time.perf_counter()
                    rc = libs[name].gguf_attention(query.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), None,
                                                   out.data_ptr(), H, KV, n, context + n, d, context + rows,
                                                   ctypes.c_float(d ** -0.5), qpos.data_ptr(), kpos.data_ptr(), 0, args.threads)
                    seconds = time.perf_counter() - t0
                    assert rc == 0
                    outs[name][n] = out
                    if sweep:
                        best[name][n] = min(best[name].get(n, float("inf")), seconds)
        equal = all(torch.equal(outs["before"][n], outs["now"][n]) for n in (1, rows))
        print(json.dumps({"context": context, "equal": equal,
                          **{f"{name}_ms": {str(n): round(s * 1000, 3) for n, s in b.items()} for name, b in best.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
