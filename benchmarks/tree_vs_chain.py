"""The confident tree against the confidence policy's chain, paired from the same contexts.

For contexts taken along sampled continuations of a few prompts (written here, not benchmark
prompts), draws the confident tree and the confidence chain from the draft at temperature 1 and
computes, exactly from each verification plan and the target's probabilities, the expected
number of tokens the target forward yields (kept draft tokens plus the appended one). A paired
difference over the same contexts has far less variance than two end-to-end runs, whose sampled
continuations part ways after the first step. Prints running means and writes
tree-vs-chain.json beside this file.

    python benchmarks/tree_vs_chain.py [--threads 2] [--draws 3] [--tokens 40] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from specdec import generate, models
from specdec.api import as_backend
from specdec.backends.base import forward_after
from specdec.drafters.model import ModelDrafter
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
from specdec.policies import ConfidenceStop
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.verify.block import BlockVerifier
from specdec.verify.tree import TreeVerifier

PROMPTS = (
    'def merge_sorted(a, b):\n    """Merge two sorted lists."""\n',
    "Explain how a hash map handles collisions.\n",
    "def is_prime(n: int) -> bool:\n",
    "Write a short story about a robot learning to paint.\n",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draws", type=int, default=3, help="drafts per context for each method")
    parser.add_argument("--tokens", type=int, default=40, help="length of each prompt's continuation")
    parser.add_argument("--every", type=int, default=3, help="a context every this many tokens")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_model, tokenizer = models.load(models.DEFAULT_TARGET, progress=False)
    draft_model, _ = models.load(models.DEFAULT_DRAFT, progress=False)
    target, draft = as_backend(target_model), as_backend(draft_model, "int8")
    law = SamplingConfig(temperature=1.0)
    contexts = []
    for i, text in enumerate(PROMPTS):
        ids = tokenizer(text)["input_ids"]
        out = generate(target, ids, temperature=1.0, seed=i, max_new_tokens=args.tokens, eos_token_ids=[]).token_ids
        contexts += [ids + out[:j] for j in range(0, args.tokens, args.every)]

    def target_law(context: list[int], extra: list[int]) -> torch.Tensor:
        return logits_to_probs(forward_after(target, context, extra), law).double()  # [1 + len(extra), V]

    tree_drafter, chain_drafter = TreeDrafter(draft, **DEFAULT_TREE), ModelDrafter(draft)
    tree_tokens, chain_tokens, tree_nodes, chain_nodes = [], [], [], []
    for n, context in enumerate(contexts):
        for r in range(args.draws):
            tree = tree_drafter.propose_tree(context, law, tree_drafter.depth, torch.Generator().manual_seed(1000 * n + r))
            rows = [target_law(context + [tree.tokens[i] for i in tree.path(node)], [])[-1] for node in range(-1, len(tree))]
            plan = TreeVerifier().plan_tree(tree, torch.stack(rows))
            depth = [0] + tree.depths
            tree_tokens.append(sum(float(plan.accept_len_probs[u]) * (depth[u] + 1) for u in range(1 + len(tree))))
            tree_nodes.append(len(tree))
            policy = ConfidenceStop()
            drafted = chain_drafter.propose(context, policy.k_max, law, torch.Generator().manual_seed(1000 * n + r),
                                            keep_going=policy.keep_going)
            chain = BlockVerifier().plan(drafted.tokens, drafted.q.double(), target_law(context, drafted.tokens.tolist()))
            chain_tokens.append(sum(float(prob) * (i + 1) for i, prob in enumerate(chain.accept_len_probs)))
            chain_nodes.append(len(drafted.tokens))
        diffs = [t - c for t, c in zip(tree_tokens, chain_tokens)]
        summary = {
            "contexts": n + 1, "draws": len(diffs),
            "tree_tokens_per_forward": statistics.mean(tree_tokens), "tree_nodes": statistics.mean(tree_nodes),
            "chain_tokens_per_forward": statistics.mean(chain_tokens), "chain_nodes": statistics.mean(chain_nodes),
            "difference": statistics.mean(diffs),
            "standard_error": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan"),
        }
        if (n + 1) % 10 == 0 or n + 1 == len(contexts):
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}), flush=True)
    command = (f"python benchmarks/tree_vs_chain.py --threads {args.threads} --draws {args.draws} "
               f"--tokens {args.tokens} --every {args.every}")
    Path(__file__).with_name("tree-vs-chain.json").write_text(json.dumps(
        {**summary, "tree": DEFAULT_TREE, "torch": torch.__version__, "command": command}, indent=1))


if __name__ == "__main__":
    main()
