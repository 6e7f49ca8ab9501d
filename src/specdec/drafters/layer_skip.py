"""Self-drafting by layer skipping (Draft & Verify, Zhang et al. 2024).

The target with a set of decoder layers skipped proposes tokens. It runs through
:class:`~specdec.backends.hf_layers.HFLayeredCausalLM` on the target's own cache: draft tokens
attend to the full model's keys and values for the context, the layers before the first skipped
one write genuine entries (reused by the verify pass, as with early exit), and the layers after it
write scratch entries that live only while the drafter drafts. No second model is held in memory.

Which layers to skip is found per model offline by :func:`specdec.layer_skip_search.search_skip_set` on a
few calibration prompts (a greedy search guided by how often the skipping model's greedy token
agrees with the target's, then timed with the engine). :func:`save_skip_set` stores the result as JSON in
``$SPECDEC_CACHE/layer_skip/`` (default ``~/.cache/specdec/layer_skip/``);
:func:`load_skip_set` reads it back, falling back to the defaults shipped in
``specdec/data/layer_skip.json`` and then to :func:`heuristic_skip_set`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from specdec.backends.base import LAYERS
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.drafters.early_exit import LayerSubsetDrafter
from specdec.drafters.registry import DrafterSpec
from specdec.options import Option, layer_indices
from specdec.paths import cache_root, model_key

SHIPPED = "layer_skip.json"  # in specdec/data: {model key: {"skip": [...], ...}}

class LayerSkipDrafter(LayerSubsetDrafter):
    """The target without the layers in ``skip`` proposes tokens.

    skip: layer indices to leave out; None loads the set saved for this model
    (:func:`load_skip_set`). ``source`` tells where the set came from.
    """

    name = "layer-skip"

    def __init__(self, target: HFLayeredCausalLM, skip: Sequence[int] | None = None) -> None:
        if not isinstance(target, HFLayeredCausalLM):
            super().__init__(target, [0])  # raises the explanatory error
        n = target.num_layers
        self.source = "given"
        if skip is None:
            skip, self.source = load_skip_set(target.model)
        self.skip = sorted(set(int(i) for i in skip))
        if any(not 0 <= i < n for i in self.skip) or len(self.skip) >= n:
            raise ValueError(f"skip must be a proper subset of the layers 0..{n - 1}, got {list(skip)}")
        super().__init__(target, [i for i in range(n) if i not in self.skip])

    def describe(self) -> dict:
        return {**super().describe(), "skip": self.skip, "source": self.source}


# -- where skip sets are kept ------------------------------------------------------------------


def cache_dir() -> Path:
    """``$SPECDEC_CACHE/layer_skip`` (default ``~/.cache/specdec/layer_skip``)."""
    return cache_root() / "layer_skip"


def save_skip_set(model: Any, result: Any) -> Path:
    """Write ``result`` (a :class:`specdec.layer_skip_search.SkipSearchResult`) as this model's skip set;
    returns the file."""
    path = cache_dir() / f"{model_key(model)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(result), indent=1))
    tmp.replace(path)
    return path


def load_skip_set(model: Any) -> tuple[list[int], str]:
    """(skip set, source): the user's searched set, else a shipped default, else the heuristic."""
    key = model_key(model)
    path = cache_dir() / f"{key}.json"
    if path.is_file():
        try:
            return [int(i) for i in json.loads(path.read_text())["skip"]], f"searched ({path})"
        except (ValueError, KeyError, TypeError):
            pass  # a damaged file: fall through to the defaults
    shipped = _shipped().get(key)
    if shipped is not None:
        return [int(i) for i in shipped["skip"]], "shipped default"
    return heuristic_skip_set(model.config.num_hidden_layers), "heuristic"


def heuristic_skip_set(num_layers: int) -> list[int]:
    """The middle fifth of the layers: a start when nothing was searched.

    The middle layers change the hidden state least on the models measured here (SmolLM2-135M,
    Qwen2.5-Coder-1.5B), while skipping one of the top layers ruins the draft.
    """
    return list(range(round(0.4 * num_layers), max(round(0.6 * num_layers), round(0.4 * num_layers) + 1)))


def _shipped() -> dict[str, Any]:
    try:
        text = resources.files("specdec").joinpath("data", SHIPPED).read_text()
    except (FileNotFoundError, ModuleNotFoundError, OSError):
        return {}
    return json.loads(text)


def _create(target: HFLayeredCausalLM, draft: None, **options: Any) -> LayerSkipDrafter:
    return LayerSkipDrafter(target, **options)


SKIP = Option("drafter", "skip", layer_indices, "layer indices from 0, joined by '/' (e.g. 3/5/7)", None,
              "--drafter layer-skip: the layers skipped, e.g. 3/5/7 (default: the set saved for the model)",
              "--skip-layers")

SPEC = DrafterSpec(name="layer-skip", create=_create, options=(SKIP,), needs=frozenset({LAYERS}))
