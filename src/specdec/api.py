"""The public API: ``generate`` and ``stream``, in the spirit of transformers' ``generate``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from specdec.backends.base import CausalLM
from specdec.backends.hf import eos_token_ids
from specdec.backends.lean import check_weights, make_backend
from specdec.drafters.base import Drafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.tree import DEFAULT_TREE, TreeDrafter
from specdec.engine import autoregressive_steps, speculative_steps, tree_steps
from specdec.policies import DraftLengthPolicy, check_k, make_policy
from specdec.sampling import SamplingConfig
from specdec.stats import GenerationStats, Step
from specdec.verify import make_verifier


@dataclass
class GenerationResult:
    """token_ids: the new tokens only; text: their decoding (None without a tokenizer)."""

    token_ids: list[int]
    text: str | None
    stats: GenerationStats
    method: str
    exact: bool = True


@dataclass
class StreamEvent:
    """Tokens appended by one step; ``from_draft[i]`` tells whether token i was a kept draft token."""

    token_ids: list[int]
    text: str
    from_draft: list[bool]
    stats: GenerationStats = field(repr=False)


def as_backend(model: Any, weights: str = "bf16") -> CausalLM:
    """Wrap a transformers model (:func:`~specdec.backends.lean.make_backend`: the lean backend
    where it applies, else :class:`~specdec.backends.hf.HFCausalLM`; ``weights="int8"`` for draft
    models only); pass a :class:`CausalLM` through unchanged."""
    if hasattr(model, "forward") and hasattr(model, "trim") and hasattr(model, "tokens"):
        return model
    return make_backend(model, weights=weights)


def stream(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    draft_weights: str = "int8",
    drafter: Drafter | str | None = None,
    drafter_options: dict[str, Any] | None = None,
    tokenizer: Any = None,
    verify: str = "block",
    k: int = 4,
    policy: str | DraftLengthPolicy = "static",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    seed: int | None = None,
    stop: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    tree: dict[str, Any] | None = None,
) -> Iterator[StreamEvent]:
    """Yield tokens as they are accepted. Arguments as for :func:`generate`.

    Bad input raises ``ValueError`` here, before the first event.
    """
    return _Run.build(**locals()).events()


def generate(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    draft_weights: str = "int8",
    drafter: Drafter | str | None = None,
    drafter_options: dict[str, Any] | None = None,
    tokenizer: Any = None,
    verify: str = "block",
    k: int = 4,
    policy: str | DraftLengthPolicy = "static",
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    seed: int | None = None,
    stop: Sequence[str] = (),
    eos_token_ids: Sequence[int] | None = None,
    tree: dict[str, Any] | None = None,
) -> GenerationResult:
    """Generate from ``target``, speculatively if a ``draft`` model or a ``drafter`` is given.

    target, draft: transformers causal LMs (or :class:`CausalLM` backends) sharing a vocabulary.
    draft_weights: ``int8`` (default) runs a llama/qwen2-style bf16 draft model on int8 copies of
    its weights (half the bytes per draft token; the output law is unchanged, only the draft's
    proposals shift slightly), ``bf16`` on its own weights.
    drafter: a :class:`Drafter`, or a name from :data:`specdec.drafters.DRAFTERS` (``model`` uses
    ``draft``; ``ngram``, ``early-exit``, ``layer-skip`` and ``heads`` need no draft model) built
    with ``drafter_options`` (e.g. ``{"exit_layer": 20}``, ``{"path": "heads/"}``).
    prompt: text (needs ``tokenizer``) or token ids. verify: ``greedy``, ``token``, ``block``, or
    ``tree`` (the draft model builds a token tree; ``tree`` holds :class:`TreeDrafter` options:
    ``choices`` for a static tree, ``threshold`` (with ``width``, ``depth``, ``budget``) for the
    confident tree, else ``depth``, ``width``, ``expand``, ``budget`` for the EAGLE-2-style
    dynamic tree; None: :data:`~specdec.drafters.tree.DEFAULT_TREE`, the confident tree).
    k: draft tokens per step (the starting/maximum length for adaptive policies).
    temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. seed fixes sampling.
    stop: strings that end generation (the text is cut before them; needs ``tokenizer``).
    Without a draft or drafter, decodes autoregressively through the same backend.

    The output follows the target's distribution under the given sampling settings exactly.
    Raises ``ValueError`` on bad input, before any model work.
    """
    run = _Run.build(**locals())
    for _ in run.events():
        pass
    return run.result()


@dataclass
class _Run:
    steps: Iterator[Step]
    tokenizer: Any
    stop: Sequence[str]
    method: str
    exact: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)
    policy: DraftLengthPolicy | None = None

    @classmethod
    def build(
        cls, *, target, prompt, draft, draft_weights, drafter, drafter_options, tokenizer, verify, k, policy, temperature, top_k,
        top_p, max_new_tokens, seed, stop, eos_token_ids, tree,
    ) -> "_Run":
        sampling = SamplingConfig(temperature, top_k, top_p)
        check_k(k)
        check_weights(draft_weights, "draft_weights")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the text")
        if isinstance(drafter, str):
            if drafter == "model":
                drafter = None  # the draft model path below
            else:
                if draft is not None:
                    raise ValueError(f"the {drafter} drafter uses no draft model; leave draft out")
                from specdec.drafters import make_drafter, target_backend

                if not isinstance(target, torch.nn.Module):
                    raise ValueError(f"the {drafter} drafter needs a transformers model as the target")
                target = target_backend(drafter, target)
                drafter = make_drafter(drafter, target, **(drafter_options or {}))
        elif drafter_options:
            raise ValueError("drafter_options go with a drafter given by name")
        if getattr(drafter, "target", None) is not None and drafter.target is not target:
            if getattr(drafter.target, "model", None) is not target:
                raise ValueError(f"the {drafter.name} drafter runs on its own target backend; pass target=drafter.target")
            target = drafter.target
        backend = as_backend(target)
        prompt_ids = _prompt_ids(prompt, tokenizer, backend)
        eos = set(eos_token_ids) if eos_token_ids is not None else eos_token_ids_of(target, tokenizer)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        backend.reset()
        common = dict(sampling=sampling, max_new_tokens=max_new_tokens, eos_ids=eos, generator=generator)
        if draft is None and drafter is None:
            return cls(autoregressive_steps(backend, prompt_ids, **common), tokenizer, stop, "ar", True)
        if draft is not None and drafter is not None:
            raise ValueError("give either a draft model or a drafter, not both")
        if drafter is None:
            draft_backend = as_backend(draft, draft_weights)
            draft_backend.reset()
            drafter = ModelDrafter(draft_backend)
        if drafter.vocab_size != backend.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({drafter.vocab_size} logits) differs from the target's "
                f"({backend.vocab_size}); use a draft from the same model family and tokenizer"
            )
        if verify == "tree":
            if isinstance(drafter, ModelDrafter):
                tree_drafter = TreeDrafter(drafter.model, **(DEFAULT_TREE if tree is None else tree))
                shape = ("static" if tree_drafter.choices else f"threshold={tree_drafter.threshold}"
                         if tree_drafter.threshold is not None else f"budget={tree_drafter.budget}")
            elif hasattr(drafter, "propose_tree"):  # e.g. the heads drafter: a static Medusa tree
                if tree and set(tree) - {"choices"}:
                    raise ValueError(f"the {drafter.name} drafter's tree takes only 'choices'")
                tree_drafter, shape = drafter, "static"
                if tree and "choices" in tree:
                    tree_drafter = type(drafter)(drafter.target, drafter.heads, tree["choices"])
            else:
                raise ValueError(f"tree verification needs a draft model or the heads drafter, not {drafter.name}")
            steps = tree_steps(backend, tree_drafter, prompt_ids, **common)
            return cls(steps, tokenizer, stop, f"spec:{drafter.name}:tree:{shape}", True)
        verifier = make_verifier(verify)
        if verify == "greedy" and not sampling.greedy:
            raise ValueError(
                "greedy verification reproduces greedy decoding only; with temperature > 0 "
                "use --verify token or --verify block"
            )
        pol = make_policy(policy, k) if isinstance(policy, str) else policy
        steps = speculative_steps(backend, drafter, verifier, pol, prompt_ids, **common)
        method = f"spec:{drafter.name}:{verifier.name}:{pol.name}:k={k}"
        if not verifier.exact:
            method += " (LOSSY)"
        return cls(steps, tokenizer, stop, method, verifier.exact, policy=pol)

    def events(self) -> Iterator[StreamEvent]:
        start = time.perf_counter()
        for step in self.steps:
            self.stats.add(step)
            self.token_ids += step.tokens
            delta, done = self._advance_text()
            self.stats.seconds = time.perf_counter() - start
            yield StreamEvent(step.tokens, delta, step.from_draft, self.stats)
            if done:
                break
        self.stats.seconds = time.perf_counter() - start
        if self.policy is not None:
            self.stats.policy = self.policy.describe()

    def _advance_text(self) -> tuple[str, bool]:
        """Decode the output so far; return the new text and whether a stop string was hit."""
        if self.tokenizer is None:
            return "", False
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for s in self.stop:
            at = full.find(s)
            if at >= 0:
                delta, self.text = full[len(self.text) : at], full[:at]
                return delta, True
        if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return "", False
        delta, self.text = full[len(self.text) :], full
        return delta, False

    def result(self) -> GenerationResult:
        text = self.text if self.tokenizer is not None else None
        return GenerationResult(self.token_ids, text, self.stats, self.method, self.exact)


def eos_token_ids_of(model: Any, tokenizer: Any) -> set[int]:
    return eos_token_ids(getattr(model, "model", model), tokenizer)


def _prompt_ids(prompt: str | Sequence[int], tokenizer: Any, backend: CausalLM) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass tokenizer= or token ids")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt is empty: give at least one token of text")
    if backend.max_context is not None and len(ids) >= backend.max_context:
        raise ValueError(
            f"the prompt has {len(ids)} tokens but the model's context holds {backend.max_context}; "
            "shorten the prompt to leave room for new tokens"
        )
    bad = [t for t in ids if not 0 <= t < backend.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{backend.vocab_size - 1})")
    return ids
