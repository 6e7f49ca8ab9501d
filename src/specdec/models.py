"""Loading models: a pack name, a local Hugging Face model directory or a ``.gguf`` file, on torch
(transformers) or llama.cpp, into a model and its tokenizer (:func:`load`), and a target with its
draft into one :class:`Pair` (:func:`load_pair`), which is what the CLI, the bench and the server
decode with.

Where a pack's weights come from, and how they are joined, hashed, converted and cached, is
:mod:`specdec.packs`. This module re-exports the names of it that user-facing code reads
(:data:`PACKS`, :data:`DEFAULT_TARGET`, :data:`DEFAULT_DRAFT`, :class:`ModelPackError`,
:data:`CACHE_ENV`); everything else is imported from :mod:`specdec.packs`.

Nothing here downloads: every ``from_pretrained`` passes ``local_files_only=True`` and a local path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdec import kernels as fast
from specdec import packs
from specdec.backends import llamacpp  # imports the optional llama-cpp-python binding only when a model loads
from specdec.backends import table as backend_table
from specdec.backends.table import AUTO, GGUF, TORCH
from specdec.backends.choice import choose_gguf_backend
from specdec.backends.gguf import LLAMACPP_HINT, KernelUnavailable, _field, _reader, load_gguf_native
from specdec.packs import DEFAULT_DRAFT, DEFAULT_TARGET, PACKS, ModelPackError  # re-exported
from specdec.paths import CACHE_ENV, cache_root

__all__ = [
    "BACKENDS", "CACHE_ENV", "DEFAULT_DRAFT", "DEFAULT_TARGET", "GGUF_BACKENDS", "PACKS", "ModelPackError", "Pair",
    "backend_choice", "check_backend", "gguf_path", "is_gguf_source", "load", "load_pair", "load_tokenizer", "logit_width", "resolve_backend",
    "resolve_dtype",
]


# --------------------------------------------------------------------------------------------
# A loaded pair


@dataclass
class Pair:
    """A loaded target and (optionally) draft sharing one tokenizer: what the CLI, the bench and the server decode with."""

    target: Any  # a transformers model or a CausalLM backend (llama.cpp)
    tokenizer: Any
    draft: Any = None  # None: no draft model
    target_name: str = "target"
    draft_name: str | None = None
    backend: str = TORCH  # "torch", "llamacpp" or "gguf": where the target runs
    backend_why: str = "asked for"  # why there, and what may differ from plain decoding there (see backend_choice)
    draft_backend: str | None = None  # where the draft model runs (None: no draft model)


def load_pair(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    *,
    backend: str = AUTO,
    cache_dir: str | Path | None = None,
    dtype: Any = "bfloat16",
    kernels: str = "auto",
    n_threads: int | None = None,
    on_load: Callable[[str, str], None] | None = None,
) -> Pair:
    """Load ``target`` and ``draft`` (each a name :func:`load` takes) into a :class:`Pair`.

    draft: None or ``"none"`` (any case) loads no draft. Before any model loads, every named pack's
    parts are checked to be installed (a missing draft pack fails before the target loads) and the
    cache directory to be writable. The target loads first, then the draft; a draft named as the
    target shares its weights (``target.fork()`` where the model has it, so each use keeps its own
    KV cache; else the same object).

    backend: ``"auto"``, ``"torch"``, ``"llamacpp"`` or ``"gguf"``, resolved for each model by
    :func:`backend_choice` (the target's reason is ``Pair.backend_why``). dtype and kernels are
    passed only to the models that run on torch (they do not apply to a GGUF's own weights);
    n_threads is the GGUF backends' thread count. on_load: called as
    ``on_load(name, backend)`` just before each model loads (the CLI prints its "loading ..." line).

    Raises :class:`ModelPackError` for a missing or corrupt pack, an unusable cache directory, an
    unknown model, a GGUF kernel that cannot be compiled (backend ``"gguf"``), or a draft whose
    logit width differs from the target's (they must share a vocabulary).
    """
    target = _checked_name(target)
    draft = None if draft is None else _checked_name(draft)
    if draft is not None and draft.lower() == "none":
        draft = None
    names = [target] + ([draft] if draft is not None else [])
    for name in names:
        check_backend(name, backend)  # before any work
    fast.use_cache_dir(cache_dir)  # the compiled kernels live in the models' cache
    if any(name in PACKS for name in names):
        packs.check_cache_dir(cache_dir, create=True)  # before loading anything
    for name in dict.fromkeys(n for n in names if n in PACKS):
        packs.locate_parts(PACKS[name])  # a missing draft pack fails before the target loads
    choices = {name: backend_choice(name, backend, cache_dir=cache_dir, n_threads=n_threads) for name in names}
    where = {name: choice["backend"] for name, choice in choices.items()}

    def load_one(name: str) -> tuple[Any, Any]:
        if on_load is not None:
            on_load(name, where[name])
        torch_options = {"dtype": dtype, "kernels": kernels} if where[name] == TORCH else {}
        return load(name, cache_dir=cache_dir, backend=where[name], n_threads=n_threads, **torch_options)

    target_model, tokenizer = load_one(target)
    pair = Pair(target_model, tokenizer, target_name=target, backend=where[target], backend_why=choices[target]["why"])
    if draft is None:
        return pair
    if draft == target:  # one set of weights; each use keeps its own KV cache
        pair.draft = target_model.fork() if hasattr(target_model, "fork") else target_model
    else:
        pair.draft, _ = load_one(draft)
        t_vocab, d_vocab = logit_width(target_model), logit_width(pair.draft)
        if t_vocab != d_vocab:
            raise ModelPackError(
                f"the draft {draft} has a {d_vocab}-token vocabulary but the target {target} has {t_vocab}",
                f"pick a draft from the target's model family (the default pair is --target "
                f"{DEFAULT_TARGET} --draft {DEFAULT_DRAFT})",
            )
    pair.draft_name = draft
    pair.draft_backend = where[draft]
    return pair


def logit_width(model: Any) -> int:
    """How many logits ``model`` gives per position (a transformers model or a CausalLM backend)."""
    if not hasattr(model, "get_output_embeddings"):  # a CausalLM backend (llama.cpp)
        return int(model.vocab_size)
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


# --------------------------------------------------------------------------------------------
# Loading one model


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: Any = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    kernels: str | None = None,
    backend: str = TORCH,
    n_threads: int | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode and ``dtype``.

    name_or_path: a pack name (see :data:`PACKS`; converted into the cache on first use), a local
    Hugging Face model directory, or a ``.gguf`` file. dtype: a ``torch.dtype`` or its name
    (``bfloat16``/``bf16``, ``float32``/``fp32``, ``float16``/``fp16``; default bfloat16). Never
    downloads.

    kernels: ``"auto"`` (the default) routes bf16 linear layers and attention through
    :mod:`specdec.kernels` where it can run (a k-token forward then costs little more than a 1-token
    one on CPUs without native bf16, and every row of a verification pass is computed bit for bit as
    a one-token step would compute it); ``"torch"`` keeps PyTorch's own.

    backend: ``"torch"`` (a transformers model), ``"llamacpp"`` (a GGUF file or pack run by
    llama.cpp: a :class:`~specdec.backends.llamacpp.LlamaCppCausalLM` on ``n_threads`` threads),
    ``"gguf"`` (the same file on specdec's own batch-invariant quantized kernel: a
    :class:`~specdec.backends.gguf.GGUFCausalLM`) or ``"auto"`` (see :func:`resolve_backend`). On
    the two GGUF backends ``dtype`` and ``kernels`` do not apply and are refused.

    Raises :class:`ModelPackError` for an unknown name, a missing or corrupt pack, or (backend
    ``"gguf"``) a kernel that cannot be compiled, ``TypeError`` for a ``name_or_path`` that is not
    text or a path. The compiled kernels are kept in ``cache_dir`` (:func:`specdec.kernels.use_cache_dir`).
    """
    name_or_path = _checked_name(name_or_path)
    fast.use_cache_dir(cache_dir)  # the compiled kernels live in the model's cache
    where = resolve_backend(name_or_path, backend, cache_dir=cache_dir, n_threads=n_threads)
    if where in GGUF_BACKENDS:
        for name, value in (("dtype", dtype), ("kernels", kernels)):
            if value is not None:
                raise ValueError(f"{name} does not apply to the {BACKEND_LABELS[where]} backend, which runs the "
                                 f"GGUF's own weights; leave {name} out, or pass backend='torch'")
        return _load_gguf(name_or_path, cache_dir, progress, n_threads, where)
    kernels = "auto" if kernels is None else kernels
    if kernels not in ("auto", "torch"):
        raise ValueError(f"kernels must be 'auto' or 'torch', got {kernels!r}")
    torch_dtype = resolve_dtype("bfloat16" if dtype is None else dtype)
    source, gguf_file = _resolve(name_or_path, cache_dir, progress)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Offline without HF_HUB_OFFLINE (no module sets environment variables): every from_pretrained
    # here and in specdec.packs passes local_files_only=True, and `source` is a local directory, so
    # transformers neither downloads nor asks the hub anything (e.g. whether a tokenizer is Mistral's).
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    # transformers 4.57.6 suspects every local tokenizer saved by 4.57.3+ of a Mistral regex bug
    # and warns; the packs are Qwen and SmolLM2 tokenizers, which it does not concern.
    extra = {"fix_mistral_regex": False} if name_or_path in PACKS else {}
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs, **extra)
    if gguf_file is not None:
        packs.fix_gguf_tokenizer(tokenizer, source / gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    if kernels == "auto":
        fast.accelerate(model)
        fast.use_invariant_attention(model)
    return model.eval(), tokenizer


BACKENDS = backend_table.CHOICES  # "auto" and each backend of specdec.backends.table
GGUF_BACKENDS = backend_table.GGUF_NAMES  # the backends that run a GGUF file's own quantized weights
BACKEND_LABELS = backend_table.LABELS  # in messages
BACKENDS_BY_NAME = backend_table.BY_NAME  # each backend's row: its label, what may differ from plain decoding


def _checked_name(name_or_path: Any) -> str:
    """``name_or_path`` as text, or a ``TypeError`` / ``ValueError`` saying what it takes."""
    wanted = f"a pack name ({', '.join(PACKS)}), a model directory or a .gguf file"
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str):
        got = "None" if name_or_path is None else f"{type(name_or_path).__name__} {name_or_path!r}"
        raise TypeError(f"name_or_path must be {wanted}, got {got}")
    if not name_or_path.strip():
        raise ValueError(f"name_or_path is empty; give {wanted}")
    return name_or_path


def resolve_backend(name_or_path: str, backend: str, *, cache_dir: str | Path | None = None,
                    n_threads: int | None = None) -> str:
    """``"torch"``, ``"llamacpp"`` or ``"gguf"``: :func:`backend_choice`'s backend."""
    return backend_choice(name_or_path, backend, cache_dir=cache_dir, n_threads=n_threads)["backend"]


def backend_choice(name_or_path: str, backend: str, *, cache_dir: str | Path | None = None,
                   n_threads: int | None = None) -> dict[str, Any]:
    """Where ``name_or_path`` runs under ``backend``, and why: ``{"backend", "why", "source"}``.

    A named backend is used as named (its reason says what may differ from plain decoding there).
    ``"auto"``: a pack or a ``.gguf`` file runs on specdec's batch-invariant GGUF kernel wherever it
    runs the file, else on llama.cpp (:func:`specdec.backends.choice.choose_gguf_backend`; a pack's
    GGUF is made ready first), on transformers only where neither can run it; anything else on
    transformers. n_threads does not enter the choice."""
    is_gguf = check_backend(name_or_path, backend)
    if backend != AUTO:
        caveat = BACKENDS_BY_NAME[backend].caveat
        return {"backend": backend, "why": "asked for" + (f"; {caveat}" if caveat else ""), "source": "asked for"}
    if not is_gguf:
        return {"backend": TORCH, "why": "not a GGUF file: transformers runs it", "source": "rule"}
    choice = choose_gguf_backend(gguf_path(name_or_path, cache_dir))
    if choice["backend"] is None:
        return {**choice, "backend": TORCH, "why": f"torch: {choice['why']}"}
    return choice


def check_backend(name_or_path: str, backend: str) -> bool:
    """Whether ``name_or_path`` names a GGUF; a ``ValueError`` / :class:`ModelPackError` where
    ``backend`` is unknown or cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    is_gguf = is_gguf_source(name_or_path)
    if backend in GGUF_BACKENDS and not is_gguf:
        raise ModelPackError(f"the {backend} backend runs GGUF files; {name_or_path} is neither a pack nor a .gguf file",
                             "pass a pack name or a .gguf file, or use the torch backend")
    return is_gguf


def is_gguf_source(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF: a pack or a ``.gguf`` file."""
    return name_or_path in PACKS or Path(name_or_path).expanduser().suffix.lower() == ".gguf"


def gguf_path(name_or_path: str, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The GGUF file a pack name (hash-checked, joined once) or a ``.gguf`` path names."""
    pack = PACKS.get(name_or_path)
    return packs.gguf_file(pack, cache_dir, progress=progress) if pack else Path(name_or_path).expanduser()


def _load_gguf(name_or_path: str, cache_dir: str | Path | None, progress: bool, n_threads: int | None,
               backend: str) -> tuple[Any, Any]:
    """A pack's hash-checked GGUF (no conversion) or a local .gguf file on ``backend`` (llama.cpp
    or specdec's GGUF kernel), and its tokenizer."""
    pack = PACKS.get(name_or_path)
    gguf = gguf_path(name_or_path, cache_dir, progress=progress)
    eos = (pack.eos_token_ids or None) if pack else None
    if backend == GGUF:
        try:
            model = load_gguf_native(gguf, n_threads=n_threads, eos_token_ids=eos)
        except ValueError as err:  # a file or a model this kernel does not run
            raise ModelPackError(str(err).replace(f"; {LLAMACPP_HINT}", ""), LLAMACPP_HINT) from None
        except KernelUnavailable as err:  # no C compiler, an unwritable cache, a failed build
            raise ModelPackError(f"specdec's GGUF kernel could not be built: {err}", LLAMACPP_HINT) from None
    else:
        model = llamacpp.load_gguf(gguf, n_threads=n_threads, eos_token_ids=eos, cache_dir=cache_dir)
    return model, _gguf_tokenizer(pack, gguf, cache_dir)


def load_tokenizer(name_or_path: str | os.PathLike, cache_dir: str | Path | None = None) -> Any:
    """The tokenizer alone of a pack or a ``.gguf`` file (read from the GGUF, so no torch conversion
    is made) or of a Hugging Face model directory; :class:`ModelPackError` for anything else."""
    name = _checked_name(name_or_path)
    path = Path(name).expanduser()
    if is_gguf_source(name) and (name in PACKS or path.is_file()):
        return _gguf_tokenizer(PACKS.get(name), gguf_path(name, cache_dir, progress=False), cache_dir)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    raise ModelPackError(
        f"unknown model {name!r}: not a pack name and no such file or directory",
        "choose a pack (" + ", ".join(PACKS) + "; see 'specdec models') or a local model directory or .gguf file",
    )


def _gguf_tokenizer(pack: packs.Pack | None, gguf: Path, cache_dir: str | Path | None) -> Any:
    """The tokenizer of a GGUF: a pack's is read once from its GGUF and kept in the cache (or taken
    from its conversion); a loose file's is read from it each time (:func:`packs.tokenizer_from_gguf`)."""
    from transformers import AutoTokenizer

    extra = {"fix_mistral_regex": False} if pack else {}
    saved = [packs.pack_dir(pack, cache_dir), cache_root(cache_dir) / "tokenizers" / pack.name] if pack else []
    for folder in saved:
        found = (folder / "tokenizer_config.json").is_file()
        if found and (folder is not saved[0] or packs.is_converted(pack, cache_dir)):
            return AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    tokenizer = packs.tokenizer_from_gguf(gguf)
    if pack:
        tokenizer.save_pretrained(saved[1])
    return tokenizer


def _resolve(name_or_path: str, cache_dir: str | Path | None, progress: bool) -> tuple[Path, str | None]:
    """(directory to load from, GGUF file name inside it or None)."""
    if name_or_path in PACKS:
        return packs.convert(PACKS[name_or_path], cache_dir, progress=progress), None
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        packs.require_gguf_support()
        packs.check_gguf(path)
        return path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPackError(
                f"{path} is a directory but not a Hugging Face model (no config.json)",
                "pass a directory written by save_pretrained, a .gguf file, or a pack name: "
                + ", ".join(PACKS),
            )
        why = packs.damage(path)
        if why is not None:
            raise ModelPackError(f"the model in {path} is damaged: {why}", "save or copy the model again")
        return path, None
    if path.exists():
        raise ModelPackError(f"{path} is not a .gguf file", "pass a .gguf file, a model directory or a pack name")
    raise ModelPackError(
        f"unknown model {name_or_path!r}: not a pack name and no such file or directory",
        "choose a pack (" + ", ".join(PACKS) + "; see 'specdec models') or a local model directory or .gguf file",
    )


_DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


def resolve_dtype(dtype: Any) -> Any:
    """A ``torch.dtype`` from a dtype or one of its names."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPES.get(str(dtype).lower().removeprefix("torch."))
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of bfloat16, float32, float16")
    return getattr(torch, name)
