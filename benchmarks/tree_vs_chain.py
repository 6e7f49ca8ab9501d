"""The confident tree against the chain it grows from, paired draw by draw (temperature 1 or greedy).

For contexts taken along sampled continuations of a few prompts (written here, not benchmark
prompts), draws the confident tree from the draft and computes, exactly from the verification
plan and the target's probabilities, the expected number of tokens the target forward yields
(kept draft tokens plus the appended one). The tree's path of first children is a draw of the
confidence policy's chain (each token drawn from the draft's law at its parent, drafted on while
the draft's top probability is at least the threshold, the first token below it kept), so the same
draw also gives the chain's expected tokens (its plan by the same verifier, which on a chain is
block verification): the difference is what the fork's other children add, with no noise from
drafting. Greedy (``--temperature 0``), the tree is a function of the context, one draw each.

It also bounds what any exact verifier could get from them: a node's path can only be kept if
the target's own sample starts with it, so a fork child adds at most P_target(its path) tokens.
And it times what they cost: one target forward over as many new tokens as each shape verifies
(rows), and a draft forward per level (the fork's leaves need none), interleaved, medians; the
predicted wall-clock ratio of tree to chain is tokens per step over time per step. Prints running
means and writes tree-vs-chain.json (tree-vs-chain-greedy.json greedy) beside this file, or --out.

    python benchmarks/tree_vs_chain.py [--temperature 1] [--threads 2] [--draws 3] [--tokens 40] [--every 3]

``--target``/``--draft`` (default: the default pair, on torch) and ``--prompts`` (how many of the
prompts below) make a small run, e.g. ``--target smollm2-135m --draft smollm2-135m --prompts 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from specdec import packs

PROMPTS = (
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
    "Explain how a hash map handles collisions.\n",
    "def is_prime(n: int) -> bool:\n",
    "Write a short story about a robot learning to paint.\n",
)


def mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def forward_ms(model, context: list[int], rows: list[int], repeats: int) -> dict[int, float]:
    """Median time of one forward over each number of rows (the last context token and r - 1
    more) after ``context``, interleaved."""
    from specdec.backends.base import forward_after

    times: dict[int, list[float]] = {r: [] for r in rows}
    forward_after(model, context)
    for _ in range(repeats):
        for r in rows:
            start = time.perf_counter()
            forward_after(model, context, list(range(1000, 999 + r)))
            times[r].append(1000 * (time.perf_counter() - start))
            forward_after(model, context)  # back to the context alone
    return {r: statistics.median(t) for r, t in times.items()}


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"takes a positive integer, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=packs.DEFAULT_TARGET, help="a pack name or a model directory")
    parser.add_argument("--draft", default=packs.DEFAULT_DRAFT, help="a pack name or a model directory")
    parser.add_argument("--prompts", type=positive, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON file (default: tree-vs-chain[-greedy].json beside this script)")
    parser.add_argument("--temperature", type=float, default=1.0, help="1 or 0 (greedy)")
    parser.add_argument("--threads", type=positive, default=2)
    parser.add_argument("--draws", type=positive, default=3, help="trees drawn per context")
    parser.add_argument("--tokens", type=positive, default=40, help="length of each prompt's continuation")
    parser.add_argument("--every", type=positive, default=3, help="a context every this many tokens")
    parser.add_argument("--repeats", type=positive, default=5, help="timed forwards per row count")
    args = parser.parse_args()
    if args.prompts > len(PROMPTS):
        parser.error(f"--prompts: there are {len(PROMPTS)} prompts")
    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy) or positive")
    # torch and the models only now: --help and a wrong argument answer at once
    import torch

    from specdec import generate, models
    from specdec.build import as_backend
    from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
    from specdec.sampling import SamplingConfig, logits_to_probs
    from specdec.token_tree import TokenTree, forward_tree
    from specdec.verify.tree import TreeVerifier

    torch.set_num_threads(args.threads)
    target_model, tokenizer = models.load(args.target, progress=False)
    draft_model, _ = models.load(args.draft, progress=False)
    target, draft = as_backend(target_model), as_backend(draft_model, "int8")
    law = SamplingConfig(temperature=args.temperature)
    draws_each = 1 if law.greedy else args.draws
    contexts = []
    for i, text in enumerate(PROMPTS[:args.prompts]):
        ids = tokenizer(text)["input_ids"]
        out = generate(target, ids, temperature=args.temperature, seed=i, max_new_tokens=args.tokens,
                       eos_token_ids=[]).token_ids
        contexts += [ids + out[:j] for j in range(0, args.tokens, args.every)]

    drafter = TreeDrafter(draft, **DEFAULT_TREE)
    draws = []  # per draw: tree tokens, chain tokens, the fork children's bound, nodes, chain nodes
    for n, context in enumerate(contexts):
        for r in range(draws_each):
            tree = drafter.propose_tree(context, law, drafter.depth, torch.Generator().manual_seed(1000 * n + r))
            p = logits_to_probs(forward_tree(target, context, tree), law).double()  # [1 + N, V]
            depth = [0] + tree.depths
            plan = TreeVerifier().plan_tree(tree, p)
            tree_tokens = sum(float(plan.accept_len_probs[u]) * (depth[u] + 1) for u in range(1 + len(tree)))
            kids, chain, u = tree.child_lists(), [], 0
            while kids[u]:
                chain.append(kids[u][0])
                u = 1 + kids[u][0]
            rows = [0] + [1 + c for c in chain]  # the chain's rows of the tree's p and q
            alone = TokenTree([tree.tokens[c] for c in chain], list(range(-1, len(chain) - 1)),
                              None if tree.q is None else tree.q[rows])
            chain_plan = TreeVerifier().plan_tree(alone, p[rows])
            chain_tokens = sum(float(x) * (i + 1) for i, x in enumerate(chain_plan.accept_len_probs))
            reach = [1.0] + [0.0] * len(tree)  # P_target(path to each node)
            for i, par in enumerate(tree.parents):
                reach[1 + i] = reach[1 + par] * float(p[1 + par, tree.tokens[i]])
            bound = sum(reach[1 + i] for i in range(len(tree)) if i not in chain)
            draws.append((tree_tokens, chain_tokens, bound, len(tree), len(chain)))
        if (n + 1) % 10 == 0 or n + 1 == len(contexts):
            gain = mean_se([d[0] - d[1] for d in draws])
            print(json.dumps({"contexts": n + 1, "tree": round(statistics.mean(d[0] for d in draws), 3),
                              "chain": round(statistics.mean(d[1] for d in draws), 3),
                              "gain": f"{gain[0]:.3f} +- {gain[1]:.3f}",
                              "bound": round(statistics.mean(d[2] for d in draws), 3)}), flush=True)

    # What a step costs: the draft forwards (one per chain level, the fork's leaves need none) and
    # one target forward over the verified rows (every node and the root).
    most = max(d[3] for d in draws) + 1
    verify = forward_ms(target, contexts[-1], list(range(1, most + 1)), args.repeats)
    draft_step = forward_ms(draft, contexts[-1], [1], args.repeats)[1]
    tree_time = [d[4] * draft_step + verify[d[3] + 1] for d in draws]
    chain_time = [d[4] * draft_step + verify[d[4] + 1] for d in draws]
    tokens = {k: statistics.mean(d[i] for d in draws) for k, i in (("tree", 0), ("chain", 1))}
    ratio = (tokens["tree"] / statistics.mean(tree_time)) / (tokens["chain"] / statistics.mean(chain_time))
    gain, gain_se = mean_se([d[0] - d[1] for d in draws])
    extra_nodes = statistics.mean(d[3] - d[4] for d in draws)
    summary = {
        "contexts": len(contexts), "draws": len(draws),
        "tree_tokens_per_forward": tokens["tree"], "tree_nodes": statistics.mean(d[3] for d in draws),
        "chain_tokens_per_forward": tokens["chain"], "chain_nodes": statistics.mean(d[4] for d in draws),
        "gain": gain, "gain_standard_error": gain_se,
        "bound_on_gain": statistics.mean(d[2] for d in draws),
        "extra_nodes": extra_nodes,
        "step_ms": {"tree": statistics.mean(tree_time), "chain": statistics.mean(chain_time)},
        "verify_ms_by_rows": verify, "draft_ms_per_level": draft_step,
        "predicted_tree_over_chain_speed": ratio,
        "tokens_needed_to_break_even": tokens["chain"] * (statistics.mean(tree_time) / statistics.mean(chain_time) - 1),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "verify_ms_by_rows"}, indent=1))
    command = (f"python benchmarks/tree_vs_chain.py --temperature {args.temperature:g} --threads {args.threads} "
               f"--draws {args.draws} --tokens {args.tokens} --every {args.every} --repeats {args.repeats}")
    command += "".join(f" --{k} {v}" for k, v in (("target", args.target), ("draft", args.draft), ("prompts", args.prompts))
                       if v != parser.get_default(k))
    name = "tree-vs-chain-greedy.json" if law.greedy else "tree-vs-chain.json"
    out = args.out or Path(__file__).with_name(name)
    out.write_text(json.dumps(
        {**summary, "tree": DEFAULT_TREE, "torch": torch.__version__, "command": command}, indent=1))


if __name__ == "__main__":
    main()
