"""Turn a :class:`~specdec.bench.runner.BenchRun` into figures: results.json, a Markdown table, plots.

Definitions (per method, over all its timed runs):

- ``tokens_per_second``: total new tokens / total wall time; ``ms_per_token``: its inverse in ms.
- ``speedup_vs_ar``: tokens_per_second / ar's tokens_per_second, where ar is the target alone on
  the method's own backend (``ar`` on torch, ``ar:backend=llamacpp`` on llama.cpp; transformers'
  peers count as torch, llama.cpp's as llamacpp) -- the ratio of total time for the same tokens
  when the token counts are equal (they are when EOS is ignored).
  ``speedup_vs_ar_geomean``: geometric mean over prompts of the same ratio per prompt. Per prompt,
  with several repeats, the ratio is of the median of each run's tokens per second: a run slowed
  by other work on the machine (llama.cpp's spinning threads can take 50x longer when the cores
  are busy) moves a median of three or more runs little and a total a lot.
- ``speedup_vs_llamacpp_ar`` (when ``llamacpp-ar`` ran): the same ratio against the llama.cpp
  binding's own generation on the target's GGUF, whatever the method's backend; ``..._geomean`` and
  ``..._min`` over prompts, and ``..._by_set`` per prompt set (geometric means);
  ``decode_speedup_vs_llamacpp_ar``: the same for decoding alone (after the first step, below).
- ``decode_speedup_vs_ar``: the same ratio for decoding alone: each run's tokens and time after
  its first step (the first target forward, which prefills the prompt; for draft-model methods the
  draft's prefill comes before it). ``first_step_seconds``: the mean time to that point. With
  prompts of a few hundred tokens and 64 new ones, prefill is a large share of a run, and it is
  the same work with or without speculation (plus the draft's own prefill).
- ``mean_accepted_per_forward``: new tokens / target forward passes (1 for ar).
- ``acceptance_rate``: accepted draft tokens / drafted tokens. ``alpha``: accepted / (accepted +
  rejections), the per-token acceptance probability the closed forms assume (a step that keeps
  all its drafts has no rejection; ``acceptance_rate`` undercounts alpha because tokens after the
  first rejection are drafted but never tested).
- ``cost_ratio_c``: median time to draft one token / median time of one ar target step (prefill
  excluded). ``predicted_speedup``: :func:`specdec.theory.expected_speedup` of alpha, the mean
  number of drafts per step and c. ``verify_step_ratio``: median target step of the method /
  median ar step (what a k-token verification costs next to a 1-token step; the formula takes 1).
- ``identical_to_ar_fraction`` (greedy runs): the share of prompts whose output equals the same
  backend's ar token for token in every repeat. ``divergences``: for each run that differs, the
  first differing position, the two tokens, and the target's top-2 logit margin there as ar's
  pass and as the method's own pass computed it (see :mod:`specdec.divergence`): a margin
  near 0 is a near-tie that kernel rounding can flip, a wide one points at a verification bug.
  At a temperature above 0 the coupled methods (Gumbel-max sampler, same seed) must give one text
  on a backend: each that differs from the first coupled method of its backend (``base``) gets the
  same record, with the margins of the noised scores that chose the tokens.

For a token tree, drafted tokens are tree nodes and accepted ones the kept path, and no
prediction is made (the closed form is for a chain). Lossy methods carry ``exact: false`` and
are marked LOSSY in the table.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap
from collections import Counter, defaultdict
from importlib.metadata import version
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from specdec import kernels
from specdec.backends.lean import lean_unsupported
from specdec.divergence import cause
from specdec.paths import write_atomic
from specdec.bench.methods import MethodSpec
from specdec.bench.runner import BenchRun, Sample
from specdec.theory import expected_speedup

PLOTS = ("speedup.png", "accepted_per_step.png", "k_sweep.png", "predicted_vs_measured.png")


# ------------------------------------------------------------------------------------------
# Figures


def summarize(run: BenchRun) -> dict[str, dict[str, Any]]:
    """Per method name, the figures listed in the module docstring."""
    by_method: dict[str, list[Sample]] = defaultdict(list)
    for s in run.samples:
        by_method[s.method].append(s)
    summary = {}
    for method in run.methods:
        samples = by_method.get(method.name, [])
        ar = by_method.get(method.ar.name, [])
        ar_runs = {(s.prompt, s.repeat): s for s in ar}
        ar_step = _median([s.step_seconds for s in ar])
        summary[method.name] = _method_summary(method, samples, ar, ar_runs, _tps(ar), ar_step, run)
        decode, ar_decode = _decode_tps(samples), _decode_tps(ar)
        firsts = [s.first_step_seconds for s in samples if s.first_step_seconds is not None]
        summary[method.name].update(
            decode_tokens_per_second=decode,
            decode_speedup_vs_ar=decode / ar_decode if decode and ar_decode else None,
            first_step_seconds=statistics.fmean(firsts) if firsts and len(firsts) == len(samples) else None,
            divergences=[d for d in run.divergences if d["method"] == method.name],
        )
        summary[method.name].update(_against_llamacpp_ar(samples, by_method.get("llamacpp-ar", []), run))
    _compare_with_peers(run.methods, summary)
    return summary


def _against_llamacpp_ar(samples: Sequence[Sample], base: Sequence[Sample], run: BenchRun) -> dict[str, Any]:
    """Speed-ups against the llama.cpp binding's own generation: overall, per prompt and per prompt set."""
    mine, theirs = _tps(samples), _tps(base)
    decode, base_decode = _decode_tps(samples), _decode_tps(base)
    per_prompt = _per_prompt_ratios(samples, base)
    by_set: dict[str, list[float]] = defaultdict(list)
    for prompt, ratio in per_prompt.items():
        by_set[run.prompts[prompt].set].append(math.log(ratio))
    logs = [math.log(r) for r in per_prompt.values()]
    return {
        "speedup_vs_llamacpp_ar": mine / theirs if mine and theirs else None,
        "speedup_vs_llamacpp_ar_geomean": math.exp(statistics.fmean(logs)) if logs else None,
        "speedup_vs_llamacpp_ar_min": min(per_prompt.values()) if per_prompt else None,
        "speedup_vs_llamacpp_ar_by_set": {k: math.exp(statistics.fmean(v)) for k, v in by_set.items()} or None,
        "decode_speedup_vs_llamacpp_ar": decode / base_decode if decode and base_decode else None,
    }


def _per_prompt_ratios(samples: Sequence[Sample], base: Sequence[Sample]) -> dict[int, float]:
    """Per prompt index: the median over its repeats of a run's tokens per second / the same for ``base``."""
    ratios = {}
    for prompt in sorted({s.prompt for s in samples}):
        mine = _median_tps([s for s in samples if s.prompt == prompt])
        theirs = _median_tps([s for s in base if s.prompt == prompt])
        if mine > 0 and theirs > 0:
            ratios[prompt] = mine / theirs
    return ratios


def _method_summary(method, samples, ar, ar_runs, ar_tps, ar_step, run) -> dict[str, Any]:
    tokens = sum(s.new_tokens for s in samples)
    seconds = sum(s.seconds for s in samples)
    forwards = sum(s.target_forwards for s in samples)
    tps = tokens / seconds if seconds > 0 else 0.0
    out: dict[str, Any] = {
        "kind": "peer" if method.is_peer else "project",
        "exact": method.exact,
        "spec": method.record(),
        "runs": len(samples),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tps,
        "ms_per_token": 1000 * seconds / tokens if tokens else None,
        "ar": method.ar.name,
        "speedup_vs_ar": tps / ar_tps if ar_tps else None,
        "speedup_vs_ar_geomean": _geomean_speedup(samples, ar),
        "target_forwards": forwards,
        "mean_accepted_per_forward": tokens / forwards if forwards else None,
    }
    out.update(_acceptance(samples))
    draft_s = sum(s.draft_seconds for s in samples)
    verify_s = sum(s.verify_seconds for s in samples)
    out.update(
        draft_seconds=draft_s,
        verify_seconds=verify_s,
        other_seconds=max(0.0, seconds - draft_s - verify_s),
        draft_fraction=draft_s / seconds if seconds else None,
        verify_fraction=verify_s / seconds if seconds else None,
    )
    draft_token = _median([s.draft_token_seconds for s in samples])
    step = _median([s.step_seconds for s in samples])
    c = draft_token / ar_step if draft_token is not None and ar_step else None
    out["cost_ratio_c"] = c
    out["verify_step_ratio"] = step / ar_step if step is not None and ar_step else None
    alpha, k = out["alpha"], out["mean_drafted_per_step"]
    chain = not method.is_tree  # the closed form describes a chain of k drafts, not a tree
    out["predicted_speedup"] = (
        expected_speedup(alpha, k, c) if chain and None not in (alpha, k, c) and k > 0 else None
    )
    out.update(_identity(samples, ar_runs, run.settings.greedy))
    return out


def _decode_tps(samples: Sequence[Sample]) -> float | None:
    """Tokens per second after the first step, over all runs; None if some run lacks its first step."""
    if not samples or any(s.first_step_seconds is None or s.first_step_tokens is None for s in samples):
        return None
    seconds = sum(s.seconds - s.first_step_seconds for s in samples)
    tokens = sum(s.new_tokens - s.first_step_tokens for s in samples)
    return tokens / seconds if seconds > 0 else None


def _tps(samples: Sequence[Sample]) -> float:
    seconds = sum(s.seconds for s in samples)
    return sum(s.new_tokens for s in samples) / seconds if seconds > 0 else 0.0


def _median_tps(samples: Sequence[Sample]) -> float:
    """The median over ``samples`` of a run's tokens per second (0 for none)."""
    return statistics.median(_tps([s]) for s in samples) if samples else 0.0


def _geomean_speedup(samples: Sequence[Sample], ar: Sequence[Sample]) -> float | None:
    ratios = [math.log(r) for r in _per_prompt_ratios(samples, ar).values()]
    return math.exp(statistics.fmean(ratios)) if ratios else None


def _acceptance(samples: Sequence[Sample]) -> dict[str, Any]:
    """Acceptance figures from the per-step counts; None when some run lacks them. Runs that report
    only their totals (llama-server) give the totals and the acceptance rate alone."""
    keys = ("drafted_tokens", "accepted_tokens", "acceptance_rate", "alpha", "mean_drafted_per_step",
            "acceptance_by_position", "accepted_per_step_histogram")
    if samples and all(not s.step_drafted and s.drafted_total is not None for s in samples):
        total_d, total_a = sum(s.drafted_total for s in samples), sum(s.accepted_total or 0 for s in samples)
        return dict.fromkeys(keys) | {"drafted_tokens": total_d, "accepted_tokens": total_a,
                                      "acceptance_rate": total_a / total_d if total_d else None}
    if not samples or any(not s.step_drafted for s in samples):
        return dict.fromkeys(keys)
    drafted = [d for s in samples for d in s.step_drafted]
    accepted = [a for s in samples for a in s.step_accepted]
    total_d, total_a = sum(drafted), sum(accepted)
    rejections = sum(a < d for a, d in zip(accepted, drafted))
    at_d, at_a = [0] * max(drafted, default=0), [0] * max(drafted, default=0)
    for a, d in zip(accepted, drafted):
        for i in range(d):
            at_d[i] += 1
            at_a[i] += i < a
    histogram = Counter(accepted)
    return {
        "drafted_tokens": total_d,
        "accepted_tokens": total_a,
        "acceptance_rate": total_a / total_d if total_d else None,
        "alpha": total_a / (total_a + rejections) if total_a + rejections else None,
        "mean_drafted_per_step": total_d / len(drafted) if drafted else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(at_a, at_d)],
        "accepted_per_step_histogram": [histogram.get(i, 0) for i in range(max(histogram, default=-1) + 1)],
    }


def _identity(samples, ar_runs, greedy: bool) -> dict[str, Any]:
    """How many prompts' outputs equal ar's (greedy runs only: sampled outputs differ by design)."""
    if not greedy or not ar_runs:
        return {"identical_to_ar_fraction": None, "identical_prompts": None, "mean_common_prefix_with_ar": None}
    same: dict[int, bool] = {}
    prefixes = []
    for s in samples:
        base = ar_runs.get((s.prompt, s.repeat))
        if base is None:
            continue
        same[s.prompt] = same.get(s.prompt, True) and s.token_ids == base.token_ids
        prefixes.append(_common_prefix(s.token_ids, base.token_ids))
    return {
        "identical_to_ar_fraction": sum(same.values()) / len(same) if same else None,
        "identical_prompts": f"{sum(same.values())}/{len(same)}",
        "mean_common_prefix_with_ar": statistics.fmean(prefixes) if prefixes else None,
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _compare_with_peers(methods: Sequence[MethodSpec], summary: dict[str, dict[str, Any]]) -> None:
    """Each project method against the fastest peer of its kind measured in the same run."""
    for method in methods:
        if method.is_peer:
            continue
        rivals = [m.name for m in methods if m.is_peer and m.kind == method.peer]
        speeds = [(summary[r]["speedup_vs_ar"] or 0.0, r) for r in rivals]
        mine = summary[method.name]
        if not speeds:
            mine.update(peer=None, peer_speedup_vs_ar=None, vs_peer=None)
            continue
        best, name = max(speeds)
        mine.update(
            peer=name,
            peer_speedup_vs_ar=best,
            vs_peer=(mine["speedup_vs_ar"] or 0.0) / best if best else None,
        )


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


# ------------------------------------------------------------------------------------------
# The environment


def environment(command: str, dtype: str) -> dict[str, Any]:
    """Versions, CPU, threads, dtype and the exact command: what a reader needs to reproduce."""
    import numpy
    import torch
    import transformers

    return {
        "command": command,
        "dtype": dtype,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            "specdec": version("specdec"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": numpy.__version__,
            "llama_cpp_python": _version("llama-cpp-python"),
        },
        "git": _git(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "fast_bf16_kernel": kernels.status(),
    }


def llamacpp_info(models: Any) -> dict[str, Any]:
    """The GGUFs the llama.cpp methods and peers run, their weights as llama.cpp describes them
    (:func:`gguf_weights`), their threads, and the weight layout the backend's models prefill on
    (:func:`specdec.backends.llamacpp.choose_prefill_layout`)."""
    layouts = {role: getattr(model, "prefill_choice", None)
               for role, model in (("target", models.target), ("draft", models.draft)) if model is not None}
    # specdec's GGUF kernel describes its weights otherwise: the file's header says it as llama.cpp does
    target, draft = (None, None) if getattr(models, "backend", "llamacpp") == "gguf" else (models.target, models.draft)
    return {"target_gguf": str(models.target_path),
            "draft_gguf": str(models.draft_path) if models.draft_path else None,
            "target_weights": gguf_weights(models.target_path, target),
            "draft_weights": gguf_weights(models.draft_path, draft) if models.draft_path else None,
            "threads": models.n_threads,
            "prefill_layout": layouts or None}


# llama.cpp's names of the K-quant mixes (llama_model_ftype_name); other file types go by their own name.
_MIXES = {"S": "Small", "M": "Medium", "L": "Large", "XS": "Extra Small", "XXS": "Extra Extra Small"}


def gguf_weights(path: str | Path | None, model: Any = None) -> str | None:
    """A GGUF's weights as llama.cpp describes them: a loaded llama.cpp model's own description
    (``model.weights.description``, e.g. 'qwen2 1.5B Q4_K - Medium'), else the architecture and file
    type read from the file's header (e.g. 'qwen2 Q4_K - Medium'); None when neither can be read."""
    described = getattr(getattr(model, "weights", None), "description", None)
    if described:
        return str(described)
    if path is None:
        return None
    try:
        meta = _gguf_metadata(Path(path), ("general.architecture", "general.file_type"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if "general.file_type" not in meta:
        return None
    from gguf import LlamaFileType

    code = int(meta["general.file_type"]) & ~1024  # LLAMA_FTYPE_GUESSED
    try:
        name = LlamaFileType(code).name.removeprefix("MOSTLY_")
    except ValueError:
        name = f"file type {code}"
    if name == "ALL_F32":
        name = "all F32"
    elif name == "Q2_K":
        name = "Q2_K - Medium"
    elif "_K_" in name and name.rsplit("_", 1)[1] in _MIXES:
        base, mix = name.rsplit("_", 1)
        name = f"{base} - {_MIXES[mix]}"
    return " ".join(str(x) for x in (meta.get("general.architecture"), name) if x)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_metadata(path: Path, keys: Sequence[str]) -> dict[str, Any]:
    """The scalar and string values of ``keys`` in a GGUF file's header (v2 or later), read until
    all are found: a few kilobytes, where the ``gguf`` package's reader maps every tensor."""
    import struct

    wanted, found = set(keys), {}
    with open(path, "rb") as f:
        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: the GGUF header ends early")
            return struct.unpack(fmt, data)[0]

        def text() -> str:
            return f.read(read("<Q")).decode("utf-8")

        def skip(kind: int) -> None:
            if kind == 8:
                f.seek(read("<Q"), 1)
            elif kind == 9:
                item, count = read("<I"), read("<Q")
                if item in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[item]), 1)
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF" or read("<I") < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        read("<Q")  # tensors
        for _ in range(read("<Q")):
            key, kind = text(), read("<I")
            if key in wanted and (kind == 8 or kind in _GGUF_SCALARS):
                found[key] = text() if kind == 8 else read(_GGUF_SCALARS[kind])
                if len(found) == len(wanted):
                    break
            else:
                skip(kind)
    return found


def run_weights(methods: Sequence[MethodSpec], dtype: str | None, models: dict[str, Any]) -> str:
    """What the run's methods computed with, for the results' header: the torch dtype where a
    method ran on transformers' weights, the GGUF's weights as llama.cpp describes them where one
    ran on llama.cpp (its peers and servers included), both when both ran."""
    backends = {m.backend for m in methods}
    parts = []
    if "torch" in backends or not backends:
        parts.append(f"{dtype} on torch" if backends & {"llamacpp", "gguf"} else str(dtype))
    for backend, where in (("llamacpp", "via llama.cpp"), ("gguf", "on specdec's GGUF kernel")):
        if backend not in backends:
            continue
        info = models.get(backend) or models.get("llamacpp") or {}  # servers on the kernel: the same files
        target, draft = info.get("target_weights"), info.get("draft_weights")
        if target and draft and draft != target:
            parts.append(f"{target} GGUF (draft: {draft}) {where}")
        else:
            parts.append(f"{target} GGUF {where}" if target else f"GGUF {where}")
    return " and ".join(parts)


def model_info(model: Any, name: str | None) -> dict[str, Any] | None:
    if model is None:
        return None
    return {
        "name": name,
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "linear_kernels": kernels.describe_model(model),
        "backend": "lean" if lean_unsupported(model) is None else f"transformers ({lean_unsupported(model)})",
    }


def _version(distribution: str) -> str | None:
    """An installed distribution's version, None if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> dict[str, Any] | None:
    try:
        root = Path(__file__).resolve().parent
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


# ------------------------------------------------------------------------------------------
# Writing


def results(run: BenchRun, env: dict[str, Any], models: dict[str, Any]) -> dict[str, Any]:
    """The whole run as plain data: what results.json holds."""
    s = run.settings
    if any(m.backend in ("llamacpp", "gguf") for m in run.methods):  # as `specdec generate --json` says it: "weights"
        env = env | {"weights": run_weights(run.methods, env.get("dtype"), models)}
        if not any(m.backend == "torch" for m in run.methods):  # and no torch dtype where torch ran nothing
            env = {k: v for k, v in env.items() if k != "dtype"}
    return {
        "environment": env,
        "models": models,
        "settings": {
            "temperature": s.temperature, "greedy": s.greedy, "top_k": 0, "top_p": 1.0,
            "max_new_tokens": s.max_new_tokens, "repeats": s.repeats, "warmup_tokens": s.warmup_tokens,
            "seed": s.seed, "eos": "ignored" if s.ignore_eos else "stops", "order": "interleaved by prompt",
            **({"server_endpoint": "chat: messages to /v1/chat/completions, each server's default sampler fields"}
               if s.endpoint == "chat" else {}),
        },
        "prompts": [p.to_dict() | {"tokens": n} for p, n in zip(run.prompts, run.prompt_tokens)],
        "methods": summarize(run),
        "skipped": run.skipped,
        "failed": run.failed,
        "wall_seconds": run.seconds,
        "resumed_samples": run.resumed,
        "samples": [x.to_dict() for x in run.samples],
    }


def write_run(data: dict[str, Any], out_dir: str | Path) -> Path:
    """Write results.json, results.md and the plots for one run into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(data, indent=1) + "\n")
    write_atomic(out / "results.md", markdown(data) + "\n")
    plot(data, out)
    return out


def title(data: dict[str, Any]) -> str:
    s, m = data["settings"], data["models"]
    mode = "greedy" if s["greedy"] else f"temperature {s['temperature']:g}"
    draft = f" / draft {m['draft']['name']}" if m.get("draft") else ""
    sets = Counter(p["set"] for p in data["prompts"])
    prompts = ", ".join(f"{n} {name}" for name, n in sets.items())
    env = data["environment"]
    weights = env.get("weights") or env.get("dtype")  # "weights" where a method ran on llama.cpp
    return (f"target {m['target']['name']}{draft}, {weights}, {mode}, "
            f"{s['max_new_tokens']} new tokens, {prompts} prompts, {s['repeats']} repeat(s)")


COLUMNS = [
    ("method", None),
    ("tok/s", "tokens_per_second"),
    ("ms/token", "ms_per_token"),
    ("speed-up vs ar", "speedup_vs_ar"),
    ("geomean", "speedup_vs_ar_geomean"),
    ("vs llamacpp-ar", "speedup_vs_llamacpp_ar"),
    ("geomean (worst)", "speedup_vs_llamacpp_ar_geomean"),
    ("decoding speed-up", "decode_speedup_vs_ar"),
    ("decoding vs llamacpp-ar", "decode_speedup_vs_llamacpp_ar"),
    ("first step (s)", "first_step_seconds"),
    ("tokens/forward", "mean_accepted_per_forward"),
    ("acceptance", "acceptance_rate"),
    ("α", "alpha"),
    ("k", "mean_drafted_per_step"),
    ("c", "cost_ratio_c"),
    ("predicted", "predicted_speedup"),
    ("draft / verify / other", None),
    ("identical to ar", "identical_prompts"),
    ("vs peer", "vs_peer"),
]


def markdown(data: dict[str, Any]) -> str:
    """The summary table, one row per method, under a line saying what was run."""
    llamacpp_ar = any(m.get("speedup_vs_llamacpp_ar") is not None for m in data["methods"].values())
    columns = [(c, key) for c, key in COLUMNS if llamacpp_ar or "vs_llamacpp_ar" not in (key or "")]
    lines = [
        f"**{title(data)}**",
        "",
        "| " + " | ".join(c for c, _ in columns) + " |",
        "|" + "|".join("---" if c == "method" else "---:" for c, _ in columns) + "|",
    ]
    for name, m in data["methods"].items():
        cells = []
        for column, key in columns:
            if column == "method":
                cells.append(f"`{name}`" + ("" if m["exact"] else " (LOSSY)"))
            elif column == "draft / verify / other":
                cells.append(_split(m))
            elif key == "vs_peer":
                cells.append(f"{_fmt(m.get(key), 'x')} {m['peer']}" if m.get("peer") else "–")
            elif key == "speedup_vs_llamacpp_ar_geomean":
                worst = m.get("speedup_vs_llamacpp_ar_min")
                cells.append(_fmt(m.get(key), "x") + (f" ({_fmt(worst, 'x')})" if worst is not None else ""))
            elif key in ("speedup_vs_ar", "speedup_vs_ar_geomean", "predicted_speedup", "decode_speedup_vs_ar",
                         "speedup_vs_llamacpp_ar", "decode_speedup_vs_llamacpp_ar"):
                cells.append(_fmt(m.get(key), "x"))
            elif key in ("acceptance_rate", "alpha"):
                cells.append(_fmt(m.get(key), "%"))
            else:
                cells.append(_fmt(m.get(key)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += _set_lines(data) if llamacpp_ar else []
    lines += _divergence_lines(data)
    for name, why in data.get("skipped", {}).items():
        lines.append(f"\n`{name}` not run: {why}.")
    for name, error in data.get("failed", {}).items():
        lines.append(f"\n`{name}` FAILED and is left out: {error}")
    if data.get("resumed_samples"):
        lines.append(f"\n{data['resumed_samples']} of the {len(data['samples'])} timed runs were made by an earlier, "
                     "interrupted invocation of the same command (`wall_seconds` counts the last one only).")
    lines.append(
        "\nSpeed-up: ratio of tokens per second to `ar` over all prompts (geomean: per prompt); "
        "decoding speed-up: the same after each run's first step, which prefills the prompt "
        "(first step: its mean time). "
        "Speed-ups and identity are against `ar` on the method's own backend (`ar:backend=llamacpp` for "
        "llama.cpp methods and peers). "
        + ("vs llamacpp-ar: ratio of tokens per second to the llama.cpp binding's own generation on the same "
           "GGUF (then: geomean over prompts, the worst prompt in brackets; decoding: after the first step). "
           if llamacpp_ar else "")
        + "tokens/forward: new tokens per target forward. α: per-token acceptance; k: drafts per step; "
        "c: one draft token's time / one `ar` step; predicted: (1-α^(k+1)) / ((1-α)(kc+1)). "
        "vs peer: speed-up over the fastest peer of the same kind (draft model: `hf-assisted`; "
        "n-gram: `hf-prompt-lookup`; none on llama.cpp). Peers' draft/verify are "
        "their models' forward times."
    )
    return "\n".join(lines)


def _set_lines(data: dict[str, Any]) -> list[str]:
    """Per prompt set, each method's geomean speed-up against llamacpp-ar."""
    rows = {name: m["speedup_vs_llamacpp_ar_by_set"] for name, m in data["methods"].items()
            if m.get("speedup_vs_llamacpp_ar_by_set")}
    sets = list(dict.fromkeys(name for by_set in rows.values() for name in by_set))
    if not rows or len(sets) < 2:
        return []
    lines = ["", "Speed-up against `llamacpp-ar` per prompt set (geomean over its prompts):", "",
             "| method | " + " | ".join(sets) + " |", "|---|" + "---:|" * len(sets)]
    for name, by_set in rows.items():
        lines.append(f"| `{name}` | " + " | ".join(_fmt(by_set.get(x), "x") for x in sets) + " |")
    return lines


def _divergence_lines(data: dict[str, Any]) -> list[str]:
    """One line per greedy run whose output left its backend's ar, and per coupled run whose text
    left the first coupled method's (same seed): where, the tokens, the margins."""
    lines = []
    for name, m in data["methods"].items():
        for d in m.get("divergences") or []:
            base = d.get("base") or m["ar"]
            what = ("the top-2 margin of the Gumbel-max scores (logits / T + noise)" if base != m["ar"]
                    else "the target's top-2 logit margin")
            margins = ", ".join(f"{d[key]:.3g} in {where}" for key, where in
                                (("ar_margin", f"`{base}`'s pass"), ("margin", "its own pass"))
                                if d.get(key) is not None)
            lines.append(
                f"\n`{name}` leaves `{base}` on {d['prompt_id']} (repeat {d['repeat']}) at new token "
                f"{d['position']}: {_token(d, 'token')} instead of {_token(d, 'ar_token')}"
                + (f"; {what} there: {margins}" if margins else "") + f"; {cause(d)}."
            )
    return lines


def _token(d: dict[str, Any], key: str) -> str:
    """A divergence's token: its id and, when known, its text."""
    if d.get(key) is None:
        return "the end of the output"
    text = d.get(f"{key}_text")
    return f"{d[key]} ({text!r})" if text is not None else str(d[key])


def _split(m: dict[str, Any]) -> str:
    if not m["seconds"]:
        return "–"
    d, v = m["draft_seconds"] / m["seconds"], m["verify_seconds"] / m["seconds"]
    return f"{d:.0%} / {v:.0%} / {max(0.0, 1 - d - v):.0%}"


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if unit == "%":
        return f"{value:.0%}"
    if unit == "x":
        return f"{value:.2f}×"
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def summary_markdown(runs: Sequence[dict[str, Any]], command: str) -> str:
    """One page for a whole invocation: the command and every run's table."""
    parts = ["# Benchmark results", "", "Produced by:", "", "```", command, "```"]
    for data in runs:
        parts += ["", markdown(data)]
    return "\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------
# Plots


def plot(data: dict[str, Any], out: Path) -> list[Path]:
    """Write the four PNGs of :data:`PLOTS` into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = data["methods"]
    heading = textwrap.fill(title(data), 90)
    paths = []
    for name, draw in zip(PLOTS, (_plot_speedup, _plot_histogram, _plot_k_sweep, _plot_predicted)):
        fig = draw(plt, methods)
        fig.suptitle(heading, fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    return paths


def _color(m: dict[str, Any]) -> str:
    return "tab:gray" if m["kind"] == "peer" else "tab:blue"


def _plot_speedup(plt, methods):
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(methods)), 4))
    names = list(methods)
    x = range(len(names))
    ax.bar(x, [methods[n]["speedup_vs_ar"] or 0 for n in names], color=[_color(methods[n]) for n in names],
           label="total time ratio")
    ax.scatter(x, [methods[n]["speedup_vs_ar_geomean"] or 0 for n in names], color="black", zorder=3,
               marker="_", s=400, label="geomean over prompts")
    ax.axhline(1.0, color="red", lw=0.8, ls="--")
    ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("speed-up vs ar")
    ax.legend(fontsize=8)
    return fig


def _plot_histogram(plt, methods):
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = {n: m["accepted_per_step_histogram"] for n, m in methods.items() if m["accepted_per_step_histogram"]}
    width = 0.8 / max(1, len(shown))
    for i, (name, counts) in enumerate(shown.items()):
        total = sum(counts)
        ax.bar([j + i * width for j in range(len(counts))], [c / total for c in counts], width=width, label=name)
    if not shown:
        ax.text(0.5, 0.5, "no speculative methods in this run", ha="center", transform=ax.transAxes)
    ax.set_xlabel("draft tokens accepted in one target forward")
    ax.set_ylabel("share of steps")
    if shown:
        ax.legend(fontsize=7)
    return fig


def _plot_k_sweep(plt, methods):
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    families: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for m in methods.values():
        spec = m["spec"]
        if spec["kind"] == "spec" and spec["verifier"] != "tree":
            backend = "" if spec.get("backend", "torch") == "torch" else f" ({spec['backend']})"
            families[f"{spec['drafter']}:{spec['verifier']}:{spec['policy']}{backend}"].append((spec["k"], m))
    for family, points in families.items():
        points.sort(key=lambda p: p[0])
        ks = [k for k, _ in points]
        left.plot(ks, [m["speedup_vs_ar"] or 0 for _, m in points], marker="o", label=family)
        right.plot(ks, [m["mean_accepted_per_forward"] or 0 for _, m in points], marker="o", label=family)
    styles = iter([":", "-.", "--", (0, (1, 3)), (0, (5, 2, 1, 2))] * 4)
    for name, m in methods.items():
        if m["kind"] == "peer" and m["speedup_vs_ar"] is not None:
            left.axhline(m["speedup_vs_ar"], ls=next(styles), color="gray", label=f"{name} (peer)")
    left.axhline(1.0, color="red", lw=0.8, ls="--")
    left.set_xlabel("k (draft tokens per step)")
    left.set_ylabel("speed-up vs ar")
    right.set_xlabel("k (draft tokens per step)")
    right.set_ylabel("tokens per target forward")
    for ax in (left, right):
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in (left, right):
        if ax.get_legend_handles_labels()[0]:  # an empty legend is a warning from matplotlib
            ax.legend(fontsize=7)
    if not families:
        left.text(0.5, 0.5, "no chain methods in this run", ha="center", transform=left.transAxes)
    return fig


def _plot_predicted(plt, methods):
    fig, ax = plt.subplots(figsize=(5, 5))
    points = [(n, m["predicted_speedup"], m["speedup_vs_ar"]) for n, m in methods.items()
              if m["predicted_speedup"] is not None and m["speedup_vs_ar"] is not None]
    markers = iter("osD^v<>pXh*" * 4)
    for name, predicted, measured in points:
        ax.scatter(predicted, measured, color=_color(methods[name]), marker=next(markers), label=name)
    top = max([1.5] + [max(p, m) * 1.1 for _, p, m in points])
    ax.plot([0, top], [0, top], color="red", lw=0.8, ls="--", label="measured = predicted")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("predicted speed-up (measured α, k, c)")
    ax.set_ylabel("measured speed-up")
    ax.legend(fontsize=7)
    return fig
