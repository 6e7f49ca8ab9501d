"""Loading models, in three steps and one pair:

- :func:`locate`: a pack name, a local Hugging Face model directory or a ``.gguf`` file to a
  :class:`Located` (its local path and what it is; a pack's GGUF joined and hash-checked there);
- :func:`load_model`: a located model on one backend (``"auto"`` chooses once: :func:`choose_backend`);
- :func:`load_tokenizer`: its tokenizer;
- :func:`load_pair`: a target with its draft into one :class:`Pair`, which is what the CLI, the
  bench and the server decode with. :func:`load` is the three steps for one model.

Where a pack's weights come from, and how they are joined, hashed, converted and cached, is
:mod:`specdec.packs`: :func:`~specdec.packs.prepare` makes a pack ready in the form a backend runs,
:func:`~specdec.packs.gguf_tokenizer` reads a GGUF's tokenizer. This module re-exports the names of
it that user-facing code reads (:data:`PACKS`, :data:`DEFAULT_TARGET`, :data:`DEFAULT_DRAFT`,
:class:`ModelPackError`, :data:`CACHE_ENV`).

Nothing here downloads: every ``from_pretrained`` passes ``local_files_only=True`` and a local path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specdec import draft_vocab as ranked
from specdec import kernels as fast
from specdec import packs
from specdec import requantize
from specdec.backends import llamacpp  # imports the optional llama-cpp-python binding only when a model loads
from specdec.backends import table as backend_table
from specdec.backends.table import AUTO, TORCH
from specdec.backends.base import ContextSizeError
from specdec.backends.choice import INSTALL_HINT, choose_gguf_backend
from specdec.backends.hf import eos_token_ids
from specdec.backends.gguf import (
    LLAMACPP_HINT, PATH_ENV, PORTABLE_ENV, KernelUnavailable, PathUnavailable, UnreadableGGUF, Unsupported,
)
from specdec.packs import DEFAULT_DRAFT, DEFAULT_TARGET, PACKS, ModelPackError  # re-exported
from specdec.paths import CACHE_ENV

__all__ = [
    "BACKENDS", "CACHE_ENV", "DEFAULT_DRAFT", "DEFAULT_TARGET", "GGUF_BACKENDS", "PACKS", "Located", "ModelPackError",
    "Pair", "check_backend", "choose_backend", "gguf_path", "is_gguf_source", "load", "load_model",
    "load_pair", "load_tokenizer", "locate", "logit_width", "resolve_dtype", "ContextSizeError",
    "MIN_CONTEXT", "check_context", "DRAFT_VOCAB", "check_draft_vocab", "trim_draft", "requantized_draft",
]

BACKENDS = backend_table.CHOICES  # "auto" and each backend of specdec.backends.table
GGUF_BACKENDS = backend_table.GGUF_NAMES  # the backends that run a GGUF file's own quantized weights
BACKEND_LABELS = backend_table.LABELS  # in messages
BACKENDS_BY_NAME = backend_table.BY_NAME  # each backend's row: its label, what may differ from plain decoding
# The subset of its vocabulary a draft model on specdec's GGUF kernel is best trimmed to by the
# per-token measurements (draft_vocab=32768, --draft-vocab 32768: the most frequent ids,
# specdec.draft_vocab): on the default pair a draft token costs 0.30 of a target step instead of
# 0.39, for 4 points of greedy agreement (benchmarks/draft_vocab.py, docs/drafters.md "A trimmed
# draft vocabulary"). Asked for, not the default: end to end on general chat, where the planner
# drafts little, it measured no faster than the full head (benchmarks/draft_vocab_end_to_end.py).
DRAFT_VOCAB = 32768
ALL_IDS = "all"  # draft_vocab's word for the full head
# The shortest context (n_ctx, --ctx-size) a model loads with: a short prompt, its answer and a draft
# (llama.cpp rounds its contexts up to a multiple of this many cells).
MIN_CONTEXT = 256


# --------------------------------------------------------------------------------------------
# Locating: a name to a local path and what it is

PACK, GGUF_FILE, HF_DIRECTORY = "pack", "gguf file", "hf directory"  # Located.kind


@dataclass(frozen=True)
class Located:
    """What a model name stands for on this machine (:func:`locate`).

    ``kind``: :data:`PACK`, :data:`GGUF_FILE` or :data:`HF_DIRECTORY`. ``path``: the GGUF file
    (a pack's installed file or its joined copy in the cache, hash-checked), or the model
    directory; a pack located for the torch backend only: the directory its bf16 conversion is
    kept in (made by :func:`load_model`). ``tokenizer``: where its tokenizer comes from,
    ``"gguf"`` (read from the GGUF; a pack keeps it in the cache) or ``"directory"``."""

    name: str  # as given
    kind: str
    path: Path
    pack: packs.Pack | None = None
    cache_dir: str | Path | None = None

    @property
    def is_gguf(self) -> bool:
        """Whether it is a GGUF (a pack or a ``.gguf`` file): what the GGUF backends run."""
        return self.kind != HF_DIRECTORY

    @property
    def tokenizer(self) -> str:
        return "directory" if self.kind == HF_DIRECTORY else "gguf"


def locate(name_or_path: str | os.PathLike, cache_dir: str | Path | None = None, *, backend: str = AUTO,
           progress: bool = True) -> Located:
    """What ``name_or_path`` names, on this machine: a pack (its parts checked installed, its GGUF
    joined once and hash-checked: :func:`specdec.packs.prepare`), a ``.gguf`` file, or a model
    directory. backend: where it will run; a pack on ``"torch"`` is checked but not joined (its
    bf16 conversion is made when it loads). Never downloads.

    Raises :class:`ModelPackError` for an unknown name, a missing or corrupt pack, a file that is
    not a ``.gguf``; ``TypeError`` / ``ValueError`` for a name that is not text or is empty."""
    name = _checked_name(name_or_path)
    pack = PACKS.get(name)
    if pack is not None:
        form = packs.GGUF if _runs_gguf(backend) else packs.PARTS
        path = packs.prepare(pack, cache_dir, form=form, progress=progress)
        return Located(name, PACK, path, pack, cache_dir)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Located(name, GGUF_FILE, path, None, cache_dir)
    if path.is_dir():
        return Located(name, HF_DIRECTORY, path, None, cache_dir)
    if path.exists():
        raise ModelPackError(f"{path} is not a .gguf file", "pass a .gguf file, a model directory or a pack name")
    raise ModelPackError(
        f"unknown model {name!r}: not a pack name and no such file or directory",
        "choose a pack (" + ", ".join(PACKS) + "; see 'specdec models') or a local model directory or .gguf file",
    )


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


def _check_threads(n_threads: Any) -> None:
    """``n_threads`` is None or a positive integer, else a ``ValueError`` naming it (before any work)."""
    if n_threads is not None and (isinstance(n_threads, bool) or not isinstance(n_threads, int) or n_threads <= 0):
        raise ValueError(f"n_threads must be a positive integer (or None: every CPU this process may use), "
                         f"got {n_threads!r}")


def _runs_gguf(backend: str) -> bool:
    """Whether ``backend`` may run a GGUF file's own weights (``"auto"``: it may)."""
    row = BACKENDS_BY_NAME.get(backend)
    return row is None or row.runs_gguf


def is_gguf_source(name_or_path: str) -> bool:
    """Whether ``name_or_path`` names a GGUF: a pack or a ``.gguf`` file."""
    return name_or_path in PACKS or Path(name_or_path).expanduser().suffix.lower() == ".gguf"


def gguf_path(name_or_path: str, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The GGUF file a pack name (hash-checked, joined once) or a ``.gguf`` path names."""
    if name_or_path in PACKS:
        return locate(name_or_path, cache_dir, progress=progress).path
    return Path(name_or_path).expanduser()


# --------------------------------------------------------------------------------------------
# Choosing the backend: once per model


def check_backend(name_or_path: str, backend: str) -> bool:
    """Whether ``name_or_path`` names a GGUF; a ``ValueError`` / :class:`ModelPackError` where
    ``backend`` is unknown or cannot run it (llama.cpp's without its binding installed). Reads the
    name only (no file is opened)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    is_gguf = is_gguf_source(name_or_path)
    if backend in GGUF_BACKENDS and not is_gguf:
        raise ModelPackError(f"the {backend} backend runs GGUF files; {name_or_path} is neither a pack nor a .gguf file",
                             "pass a pack name or a .gguf file, or use the torch backend")
    if backend != AUTO and not BACKENDS_BY_NAME[backend].available():  # llama.cpp's binding is not installed
        raise _llamacpp_missing()
    return is_gguf


def _llamacpp_missing(state: str = "is not installed") -> ModelPackError:
    """The llama.cpp backend asked for by name, its binding not installed (or not importable)."""
    return ModelPackError(f"the llama.cpp backend needs llama.cpp's binding (llama-cpp-python), which {state}",
                          f"{llamacpp.INSTALL} (it compiles llama.cpp: about 6 minutes on 2 "
                          "cores), or run the file on specdec's own kernel: --backend gguf (or auto)")


def _file_error(err: ValueError) -> ModelPackError | None:
    """A GGUF file's error from specdec's kernel (:mod:`specdec.backends.gguf`) as a
    :class:`ModelPackError` whose hint fits it: a file that is not a whole GGUF, one the kernel
    does not run, a kernel path the environment asks for and this CPU lacks. None for another error."""
    if isinstance(err, UnreadableGGUF):
        return ModelPackError(str(err), "copy or download the .gguf file again and compare its size and sha256 with "
                                        "the source (a pack: reinstall it)")
    if isinstance(err, Unsupported):
        return ModelPackError(str(err).replace(f"; {LLAMACPP_HINT}", ""), LLAMACPP_HINT)
    if isinstance(err, PathUnavailable):
        return ModelPackError(str(err), f"unset ${PATH_ENV} (and ${PORTABLE_ENV}) to run the best path this CPU has, "
                                        "or name a path it runs")
    return None


def choose_backend(located: Located, backend: str) -> dict[str, Any]:
    """Where ``located`` runs under ``backend`` (checked by :func:`check_backend`), and why:
    ``{"backend", "why", "source"}``.

    A named backend is used as named (its reason says what may differ from plain decoding there).
    ``"auto"``: a pack or a ``.gguf`` file runs on specdec's batch-invariant GGUF kernel wherever it
    runs the file, else on llama.cpp (:func:`specdec.backends.choice.choose_gguf_backend`); where
    neither can run it here, a :class:`ModelPackError` says to install llama.cpp's binding (a GGUF
    goes to transformers only when ``backend="torch"`` asks for it). Anything else runs on
    transformers. A GGUF that is not a whole file, or a kernel path the environment asks for and
    this CPU lacks, is a :class:`ModelPackError` too."""
    if backend != AUTO:
        caveat = BACKENDS_BY_NAME[backend].caveat
        return {"backend": backend, "why": "asked for" + (f"; {caveat}" if caveat else ""), "source": "asked for"}
    if not located.is_gguf:
        return {"backend": TORCH, "why": "not a GGUF file: transformers runs it", "source": "rule"}
    try:
        choice = choose_gguf_backend(located.path)
    except ValueError as err:
        known = _file_error(err)
        if known is None:
            raise
        raise known from None
    if choice["backend"] is None:
        raise ModelPackError(choice["why"], INSTALL_HINT)  # the kernel's refusal, and llama.cpp's binding missing
    return choice


# --------------------------------------------------------------------------------------------
# Loading a located model, and its tokenizer


def load_model(
    located: Located,
    backend: str,
    *,
    dtype: Any = "bfloat16",
    kernels: str = "auto",
    n_threads: int | None = None,
    n_ctx: int | None = None,
    progress: bool = True,
) -> Any:
    """The model ``located`` names, on ``backend`` (``"torch"``, ``"llamacpp"`` or ``"gguf"``, as
    :func:`choose_backend` chose it): a transformers model in eval mode (dtype and kernels as
    :func:`load` takes them), or a GGUF's own weights on llama.cpp
    (:class:`~specdec.backends.llamacpp.LlamaCppCausalLM`) or specdec's kernel
    (:class:`~specdec.backends.gguf.GGUFCausalLM`) on ``n_threads`` threads with room for
    ``n_ctx`` tokens (None: the backend's default, 4,096 or the model's trained context if shorter;
    :func:`check_context`). A pack on torch is converted into its cache directory first (once).
    Raises :class:`ModelPackError` for a model the backend cannot load, or a context above the one
    the model was trained on (read from the GGUF)."""
    check_context(n_ctx, backend, located.name)
    fast.use_cache_dir(located.cache_dir)  # the compiled kernels live in the models' cache
    row = BACKENDS_BY_NAME[backend]
    if row.runs_gguf:
        gguf = _gguf_of(located) or packs.prepare(located.pack, located.cache_dir, form=packs.GGUF, progress=progress)
        return _load_gguf(gguf, located, row, n_threads, n_ctx)
    if kernels not in ("auto", "torch"):
        raise ValueError(f"kernels must be 'auto' or 'torch', got {kernels!r}")
    torch_dtype = resolve_dtype(dtype)
    source, gguf_file = _torch_source(located, progress)
    from transformers import AutoModelForCausalLM

    # Offline without HF_HUB_OFFLINE (no module sets environment variables): every from_pretrained
    # here and in specdec.packs passes local_files_only=True, and `source` is a local directory, so
    # transformers neither downloads nor asks the hub anything (e.g. whether a tokenizer is Mistral's).
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    if kernels == "auto":
        fast.accelerate(model)
        fast.use_invariant_attention(model)
    return model.eval()


def _load_gguf(gguf: Path, located: Located, row: backend_table.Backend, n_threads: int | None,
               n_ctx: int | None) -> Any:
    """A GGUF file on the backend of ``row`` (llama.cpp or specdec's GGUF kernel), each backend's
    errors said as a :class:`ModelPackError` with the hint that fits it."""
    eos = (located.pack.eos_token_ids or None) if located.pack else None
    try:
        return row.load(gguf, n_threads=n_threads, n_ctx=n_ctx, eos_token_ids=eos, cache_dir=located.cache_dir)
    except ContextSizeError as err:  # more than the model's trained context
        raise ModelPackError(err.message, err.hint) from None
    except ValueError as err:  # the kernel's: a damaged file, a model it does not run, a path it lacks
        known = _file_error(err)
        if known is None:  # a bad argument (n_ctx), or llama.cpp's own error: said as it is
            raise
        raise known from None
    except KernelUnavailable as err:  # no C compiler, an unwritable cache, a failed build
        raise ModelPackError(f"specdec's GGUF kernel could not be built: {err}", LLAMACPP_HINT) from None
    except llamacpp.LlamaCppUnavailable as err:  # installed, yet it does not import (e.g. its library fails to load)
        raise _llamacpp_missing(f"does not import here ({err.reason})") from None


def check_context(n_ctx: int | None, backend: str, name: str = "the model") -> None:
    """``n_ctx`` is a context ``backend`` can be loaded with: None (the backend's default), or on a
    GGUF backend an integer of at least :data:`MIN_CONTEXT` tokens (whether the model was trained
    on that many, its loader checks). Raises :class:`~specdec.backends.base.ContextSizeError` (a
    ``ValueError``) naming what is wrong."""
    if n_ctx is None:
        return
    if not BACKENDS_BY_NAME[backend].runs_gguf:
        raise ContextSizeError(f"n_ctx (--ctx-size) sets the context of the GGUF backends, but {name} runs on "
                               f"{BACKEND_LABELS[backend]}, where the context is the model's own",
                               "leave n_ctx out, or run a GGUF file or pack on backend 'gguf' or 'llamacpp'")
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int):
        raise ContextSizeError(f"n_ctx must be a number of tokens (an integer), got {n_ctx!r}",
                               f"give n_ctx={MIN_CONTEXT} or more")
    if n_ctx < MIN_CONTEXT:
        raise ContextSizeError(f"a context of {n_ctx} tokens is too short to decode in", f"give n_ctx={MIN_CONTEXT} "
                               f"or more (--ctx-size {MIN_CONTEXT}); the default is 4096")


def _torch_source(located: Located, progress: bool) -> tuple[Path, str | None]:
    """(directory transformers loads from, GGUF file name inside it or None)."""
    if located.kind == PACK:
        return packs.prepare(located.pack, located.cache_dir, form=packs.BF16, progress=progress), None
    path = located.path
    if located.kind == GGUF_FILE:
        packs.check_gguf(path)
        return path.parent, path.name
    wanted = "pass a directory written by save_pretrained, a .gguf file, or a pack name: " + ", ".join(PACKS)
    if not (path / "config.json").is_file():
        raise ModelPackError(f"{path} is a directory but not a Hugging Face model (no config.json)", wanted)
    if not _model_config(path / "config.json"):
        raise ModelPackError(f"{path / 'config.json'} is not a model's configuration (no model_type: transformers "
                             "would not know which model it describes)", wanted)
    why = packs.damage(path)
    if why is not None:
        raise ModelPackError(f"the model in {path} is damaged: {why}", "save or copy the model again")
    return path, None


def _model_config(config: Path) -> bool:
    """Whether ``config`` (a config.json that exists) reads as a model's configuration: a JSON
    object naming its ``model_type``. A file that does not parse is left to :func:`specdec.packs.damage`."""
    try:
        value = json.loads(config.read_text())
    except (OSError, ValueError):
        return True  # unreadable or cut short: damage says so
    return isinstance(value, dict) and isinstance(value.get("model_type"), str) and bool(value["model_type"])


def load_tokenizer(source: Located | str | os.PathLike, cache_dir: str | Path | None = None) -> Any:
    """The tokenizer of a located model (or of a name, located first): a GGUF's is read from the
    file, so no torch conversion is needed (a pack's once, then kept in the cache or taken from its
    conversion: :func:`specdec.packs.gguf_tokenizer`), a model directory's from the directory.
    :class:`ModelPackError` for a name that locates nothing."""
    located = source if isinstance(source, Located) else locate(source, cache_dir, progress=False)
    if located.kind == HF_DIRECTORY:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(located.path, local_files_only=True)
    return packs.gguf_tokenizer(_gguf_of(located), pack=located.pack, cache_dir=located.cache_dir)


def _gguf_of(located: Located) -> Path | None:
    """The GGUF file of a located GGUF; None for a pack located for torch (its GGUF not checked yet)."""
    return located.path if located.path.suffix.lower() == ".gguf" else None


def check_draft_vocab(draft_vocab: Any) -> int | str | None:
    """``draft_vocab`` as :func:`load_pair` takes it: None (the default), ``"all"`` (any case) or a
    positive number of ids. Raises ``ValueError`` naming what is wrong."""
    if draft_vocab is None:
        return None
    if isinstance(draft_vocab, str) and draft_vocab.strip().lower() == ALL_IDS:
        return ALL_IDS
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab <= 0:
        raise ValueError(f"draft_vocab must be a positive number of ids or 'all', got {draft_vocab!r}")
    return draft_vocab


def trim_draft(draft: Any, tokenizer: Any, draft_vocab: int | str | None, backend: str, *, name: str = "the draft",
               eos_ids: Any = (), cache_dir: str | Path | None = None, progress: bool = True) -> tuple[Any, int | None]:
    """The draft model with its head trimmed to the ``draft_vocab`` most frequent ids of its
    vocabulary (:mod:`specdec.draft_vocab`; its special and chat-template tokens and ``eos_ids``
    always among them), and how many ids it scores (None: every one). Trims a draft on specdec's
    GGUF kernel only: ``draft_vocab`` None (the default) and ``"all"`` are the full head; a number
    at least the vocabulary's size is too (:data:`DRAFT_VOCAB` is the size the measurements favour). A number asked for a draft on another backend is refused
    (:class:`ModelPackError`)."""
    draft_vocab = check_draft_vocab(draft_vocab)
    if draft_vocab is None or draft_vocab == ALL_IDS:
        return draft, None
    if not BACKENDS_BY_NAME[backend].trims_draft_head:
        raise ModelPackError(f"draft_vocab (--draft-vocab) trims the head of a draft on specdec's GGUF kernel, but "
                             f"{name} runs on {BACKEND_LABELS[backend]}",
                             "leave draft_vocab out (or give 'all'), or run the draft on backend 'gguf'")
    size = draft_vocab
    if size >= draft.vocab_size:
        return draft, None
    ranking = ranked.ranking(tokenizer, draft.vocab_size, cache_dir=cache_dir, progress=progress)
    always = ranked.always_kept(tokenizer, [*eos_ids, *eos_token_ids(draft)])
    ids = ranked.subset(ranking, size, always)
    return draft.trimmed(ids), len(ids)


# --------------------------------------------------------------------------------------------
# One model, and a pair


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: Any = None,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    kernels: str | None = None,
    backend: str = TORCH,
    n_threads: int | None = None,
    n_ctx: int | None = None,
    draft_vocab: int | str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer: :func:`locate`, :func:`load_model`, :func:`load_tokenizer`.

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
    :class:`~specdec.backends.gguf.GGUFCausalLM`) or ``"auto"`` (see :func:`choose_backend`). On
    the two GGUF backends ``dtype`` and ``kernels`` do not apply and are refused.

    n_ctx: on the GGUF backends, the context in tokens that the model's KV cache holds (default
    4,096, or the model's trained context if shorter; at least :data:`MIN_CONTEXT`, at most the
    trained context; :func:`check_context`). On torch it does not apply and is refused.

    draft_vocab: for a model to draft with on specdec's GGUF kernel, how many ids its head scores,
    the most frequent of its vocabulary (:func:`trim_draft`); None or ``"all"``: every id.

    Raises :class:`ModelPackError` for an unknown name, a missing or corrupt pack, or (backend
    ``"gguf"``) a kernel that cannot be compiled, ``TypeError`` for a ``name_or_path`` that is not
    text or a path. The compiled kernels are kept in ``cache_dir`` (:func:`specdec.kernels.use_cache_dir`).
    """
    name = _checked_name(name_or_path)
    check_backend(name, backend)
    _check_threads(n_threads)
    if backend in GGUF_BACKENDS:
        for option, value in (("dtype", dtype), ("kernels", kernels)):
            if value is not None:
                raise ValueError(f"{option} does not apply to the {BACKEND_LABELS[backend]} backend, which runs the "
                                 f"GGUF's own weights; leave {option} out, or pass backend='torch'")
    fast.use_cache_dir(cache_dir)
    located = locate(name, cache_dir, backend=backend, progress=progress)
    where = choose_backend(located, backend)["backend"]
    check_context(n_ctx, where, name)
    draft_vocab = check_draft_vocab(draft_vocab)
    if isinstance(draft_vocab, int) and not BACKENDS_BY_NAME[where].trims_draft_head:
        trim_draft(None, None, draft_vocab, where, name=name)  # refused before the model loads
    if BACKENDS_BY_NAME[where].runs_gguf:
        model = load_model(located, where, n_threads=n_threads, n_ctx=n_ctx, progress=progress)
        tokenizer = load_tokenizer(located)
        if draft_vocab is not None:
            model, _ = trim_draft(model, tokenizer, draft_vocab, where, name=name, cache_dir=cache_dir, progress=progress)
        return model, tokenizer
    options = {"dtype": "bfloat16" if dtype is None else dtype, "kernels": "auto" if kernels is None else kernels}
    model = load_model(located, where, n_threads=n_threads, progress=progress, **options)
    return model, load_tokenizer(located)


@dataclass
class Pair:
    """A loaded target and (optionally) draft sharing one tokenizer: what the CLI, the bench and the
    server decode with. ``target_name`` is also the model id the server's clients pass."""

    target: Any  # a transformers model or a CausalLM backend (llama.cpp, the GGUF kernel)
    tokenizer: Any
    draft: Any = None  # None: no draft model
    target_name: str = "target"
    draft_name: str | None = None
    backend: str = TORCH  # "torch", "llamacpp" or "gguf": where the target runs
    backend_why: str = "asked for"  # why there, and what may differ from plain decoding there (see choose_backend)
    draft_backend: str | None = None  # where the draft model runs (None: no draft model)
    draft_weights: str = "int8"  # how a draft model on torch drafts: int8 copies of its weights or its own bf16 ones
    draft_vocab: int | None = None  # how many ids the draft's head scores (a trimmed head); None: every id
    draft_quant: str | None = None  # the type the draft's layers were requantized to (None: its file's own)


def load_pair(
    target: str | os.PathLike,
    draft: str | os.PathLike | None,
    *,
    backend: str = AUTO,
    cache_dir: str | Path | None = None,
    dtype: Any = "bfloat16",
    kernels: str = "auto",
    n_threads: int | None = None,
    n_ctx: int | None = None,
    draft_vocab: int | str | None = None,
    draft_quant: str | None = None,
    on_load: Callable[[str, str], None] | None = None,
) -> Pair:
    """Load ``target`` and ``draft`` (each a name :func:`locate` takes) into a :class:`Pair`.

    draft: None or ``"none"`` (any case) loads no draft. Before any model loads, each name is
    checked against ``backend``, the cache directory to be writable (where a pack is named) and
    every model located (a missing or corrupt draft pack fails before the target loads), and the
    backend of each chosen once (:func:`choose_backend`; the target's reason is
    ``Pair.backend_why``). The target loads first, then the draft; a draft named as the target
    shares its weights (``target.fork()`` where the model has it, so each use keeps its own KV
    cache; else the same object).

    dtype and kernels are passed only to the models that run on torch (they do not apply to a
    GGUF's own weights); n_threads and n_ctx (None: the backend's default) are the GGUF backends'
    (n_ctx: each model's context in tokens, as :func:`load` takes it; refused where a model runs on torch).
    draft_vocab: how many ids a draft on specdec's GGUF kernel scores, the most frequent of its
    vocabulary (:func:`trim_draft`; ``Pair.draft_vocab`` says how many it does): None (the default) and
    ``"all"`` every id, a number that many (:data:`DRAFT_VOCAB`: the size the measurements favour).
    draft_quant: None (the default: the draft's file as it is) or ``"q4_0"``: a draft run from its
    GGUF (either GGUF backend) loads a copy whose layers' Q5_0, Q5_1 and Q8_0 tensors are in Q4_0
    (:func:`specdec.requantize.requantized`, made once into the cache): fewer bytes a draft
    token, some agreement with the target lost, the output unchanged.
    on_load: called as ``on_load(name, backend)`` just before each model loads (the CLI prints its
    "loading ..." line).

    Raises :class:`ModelPackError` for a missing or corrupt pack, an unusable cache directory, an
    unknown model, a GGUF kernel that cannot be compiled (backend ``"gguf"``), or a draft whose
    logit width differs from the target's (they must share a vocabulary).
    """
    target = _checked_name(target)
    draft = None if draft is None else _checked_name(draft)
    if draft is not None and draft.lower() == "none":
        draft = None
    draft_vocab = check_draft_vocab(draft_vocab)
    draft_quant = requantize.check_format(draft_quant)
    names = list(dict.fromkeys([target] + ([draft] if draft is not None else [])))
    for name in names:
        check_backend(name, backend)  # before any work
    _check_threads(n_threads)
    fast.use_cache_dir(cache_dir)  # the compiled kernels live in the models' cache
    found = {name: locate(name, cache_dir, backend=backend) for name in names}  # before any model loads
    choices = {name: choose_backend(found[name], backend) for name in names}
    where = {name: choice["backend"] for name, choice in choices.items()}
    for name in names:
        check_context(n_ctx, where[name], name)  # before any model loads
    if draft is not None and isinstance(draft_vocab, int) and not BACKENDS_BY_NAME[where[draft]].trims_draft_head:
        trim_draft(None, None, draft_vocab, where[draft], name=draft)  # refused before any model loads
    if draft is not None and draft_quant is not None:
        found[draft] = requantized_draft(found[draft], draft, draft_quant, where[draft], target)

    def load_one(name: str) -> Any:
        if on_load is not None:
            on_load(name, where[name])
        options = {"n_ctx": n_ctx} if BACKENDS_BY_NAME[where[name]].runs_gguf else {"dtype": dtype, "kernels": kernels}
        return load_model(found[name], where[name], n_threads=n_threads, **options)

    target_model = load_one(target)
    pair = Pair(target_model, load_tokenizer(found[target]), target_name=target, backend=where[target],
                backend_why=choices[target]["why"])
    if draft is None:
        return pair
    if draft == target:  # one set of weights; each use keeps its own KV cache
        pair.draft = target_model.fork() if hasattr(target_model, "fork") else target_model
    else:
        pair.draft = load_one(draft)
        t_vocab, d_vocab = logit_width(target_model), logit_width(pair.draft)
        if t_vocab != d_vocab:
            raise ModelPackError(
                f"the draft {draft} has a {d_vocab}-token vocabulary but the target {target} has {t_vocab}",
                f"pick a draft from the target's model family (the default pair is --target "
                f"{DEFAULT_TARGET} --draft {DEFAULT_DRAFT})",
            )
    pair.draft, pair.draft_vocab = trim_draft(pair.draft, pair.tokenizer, draft_vocab, where[draft], name=draft,
                                              eos_ids=eos_token_ids(target_model), cache_dir=cache_dir)
    pair.draft_name = draft
    pair.draft_backend = where[draft]
    pair.draft_quant = draft_quant
    return pair


def requantized_draft(located: Located, name: str, to: str, backend: str, target: str) -> Located:
    """``located`` with its GGUF swapped for the copy whose layers are in ``to``
    (:func:`specdec.requantize.requantized`); refused where the draft does not run from its GGUF,
    or is the target itself (its weights are the target's)."""
    if name == target:
        raise ModelPackError(f"draft_quant (--draft-quant) requantizes a draft model's own weights, but the draft "
                             f"{name} is the target", "leave draft_quant out, or name another draft")
    gguf = _gguf_of(located)
    if not BACKENDS_BY_NAME[backend].runs_gguf or gguf is None:
        raise ModelPackError(f"draft_quant (--draft-quant) requantizes a draft run from its GGUF, but {name} runs on "
                             f"{BACKEND_LABELS[backend]}", "leave draft_quant out, or run the draft on backend 'gguf'")
    try:
        path = requantize.requantized(gguf, to, located.cache_dir,
                                      note=lambda line: print(f"specdec: {line}", file=sys.stderr, flush=True))
    except OSError as err:
        raise ModelPackError(f"could not write the requantized copy of {name}: {err}",
                             "free disk space in the cache directory (--cache-dir or $SPECDEC_CACHE)") from None
    return dataclasses.replace(located, path=path)


def logit_width(model: Any) -> int:
    """How many logits ``model`` gives per position (a transformers model or a CausalLM backend)."""
    if not hasattr(model, "get_output_embeddings"):  # a CausalLM backend (llama.cpp)
        return int(model.vocab_size)
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


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
