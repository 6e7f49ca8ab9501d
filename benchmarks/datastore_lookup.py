"""How long a retrieval datastore takes to build and to search (specdec.datastore).

A store of ``--tokens`` token ids (uniform over a 50,000-id vocabulary, with 1 in 5 tokens copied
from earlier passages of 300, so that long matches exist) in documents of 5,000, then
``--lookups`` searches, half after the tail of a stored passage (long matches) and half after
random text (short ones): each a lookup of 8 continuation tokens, the trie of the 64 most recent
continuations and the 16-node tree the retrieval drafter would propose. Prints JSON.

    python benchmarks/datastore_lookup.py --tokens 1000000 --lookups 2000
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from specdec.datastore import Datastore, continuation_trie, top_nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    corpus = rng.integers(0, 50_000, args.tokens)
    for _ in range(args.tokens // 1500):  # a fifth of the tokens repeat an earlier passage
        a, b = sorted(rng.integers(0, args.tokens - 300, 2))
        corpus[b:b + 300] = corpus[a:a + 300]
    store = Datastore()
    for start in range(0, args.tokens, 5000):
        store.add(corpus[start:start + 5000])
    t0 = time.perf_counter()
    store.lookup(corpus[:4].tolist(), 8)  # builds the index
    build = time.perf_counter() - t0
    times, cpu_times, lengths = [], [], []  # wall and this process's CPU seconds per lookup
    for i in range(args.lookups):
        at = int(rng.integers(100, args.tokens))
        context = corpus[at - 100:at].tolist() if i % 2 else rng.integers(0, 50_000, 100).tolist()
        t, cpu = time.perf_counter(), time.process_time()
        match = store.lookup(context, 8)
        top_nodes(continuation_trie(match.rows) if match else [], 16, 8)
        times.append(time.perf_counter() - t)
        cpu_times.append(time.process_time() - cpu)
        lengths.append(match.length if match else 0)
    ms, cpu_ms = np.array(times) * 1e3, np.array(cpu_times) * 1e3
    print(json.dumps({"tokens": len(store), "build_seconds": round(build, 3),
                      "lookup_ms": {"median": round(float(np.median(ms)), 3), "p90": round(float(np.percentile(ms, 90)), 3),
                                    "p99": round(float(np.percentile(ms, 99)), 3), "max": round(float(ms.max()), 3)},
                      "lookup_cpu_ms": {"median": round(float(np.median(cpu_ms)), 3),
                                        "p99": round(float(np.percentile(cpu_ms, 99)), 3)},
                      "match_length_median": float(np.median(lengths))}, indent=1))


if __name__ == "__main__":
    main()
