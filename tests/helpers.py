"""What several test modules share: tiny models and tokenizers, a server in a thread, the command
line run in-process, exact and sampled output laws, the planner's made-up costs, fixtures.

Test modules import these from here, never from one another.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import itertools
import json
import os
import socket
import threading
import time
import zlib
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from specdec import cli, generate, kernels, packs
from specdec.backends import llamacpp
from specdec.backends.hf import HFCausalLM
from specdec.backends.hf_layers import HFLayeredCausalLM
from specdec.build import make_drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_head import EagleConfig, EagleHead
from specdec.drafters.heads import HeadsDrafter
from specdec.drafters.medusa import HeadsConfig, MedusaHeads
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NGramDrafter
from specdec.engine import autoregressive_steps
from specdec.packs import Pack, Part
from specdec.costs import CostModel
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.verify.base import VerifyPlan
from specdec.verify.tree import TreeVerifier
from tiny import noisy_copy, tiny_llama

# The repository's root folder (README.md, docs/, benchmarks/, .ci/), wherever the test file sits.
REPO = Path(__file__).resolve().parents[1]

# The threads a test's real model runs on: this process's CPUs (under pytest-xdist, the worker's own
# share: conftest pins each worker to it).
THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

if TYPE_CHECKING:
    import httpx
    import openai


# ----------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run far faster on one thread than on two threads of a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Directories: a target, a draft of the same vocabulary, and a model of another vocabulary."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "target": str(make_model_dir(root / "target", seed=0, chat=True)),
        "draft": str(make_model_dir(root / "draft", seed=1)),
        "other": str(make_model_dir(root / "other", extra_vocab=44, seed=2)),
    }


# ----------------------------------------------------------------------------------------------
# Tiny models and tokenizers


VOCAB = 32
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


class CharTokenizer:
    """Characters to ids in [2, VOCAB); no chat template."""

    eos_token_id = 1
    pad_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [2 + ord(c) % (VOCAB - 2) for c in text]}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return "".join(chr(65 + i % 26) for i in ids)


def tiny_tokenizer(fim: bool = True) -> Any:
    """Byte-level BPE over the 256 bytes (no merges), the FIM tokens, a chat template; no EOS, so a
    generation always runs to its token limit."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": FIM if fim else ["<|x1|>", "<|x2|>", "<|x3|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_pair(noise: float = 0.05) -> tuple[Any, Any]:
    """A 2-layer llama over the tokenizer's 259 ids, and a draft that mostly agrees with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).float().eval()
    target.generation_config.eos_token_id = None
    return target, noisy_copy(target, noise)


def make_model_dir(path: Path, *, extra_vocab: int = 0, seed: int = 0, chat: bool = False) -> Path:
    """A 2-layer llama with a byte-level tokenizer (256 tokens, no EOS: it always runs to the limit).

    Large initial weights keep the logits far apart, so argmax ties (and numerics) cannot flip
    greedy choices between one-token and many-token forward passes.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(bytes_to_unicode().values())}
    backend = Tokenizer(BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    if chat:
        tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    config = LlamaConfig(
        vocab_size=len(vocab) + extra_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=1.0, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _tiny_qwen2(seed: int, vocab: int = 64, context: int = 512) -> Qwen2ForCausalLM:
    """A random qwen2: q/k/v biases, grouped-query attention, untied head."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=context, tie_word_embeddings=False, rope_theta=10000.0,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # transformers zero-initialises biases: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


needs_kernel = pytest.mark.skipif(kernels.status() != "available", reason=f"fast kernel {kernels.status()}")


def _on_kernels(model):
    model = model.to(torch.bfloat16)
    kernels.accelerate(model)
    assert kernels.use_invariant_attention(model)
    return model


def random_heads(model, num_heads: int, kept: list[int], seed: int = 0, scale: float = 0.5) -> MedusaHeads:
    hidden = model.config.hidden_size
    config = HeadsConfig(num_heads, hidden, model.config.vocab_size, len(kept), "tiny")
    heads = MedusaHeads(config, torch.tensor(kept))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in heads.blocks:
            block.linear.weight.copy_(torch.randn(hidden, hidden, generator=gen) * scale / hidden**0.5)
    return heads


def random_head(model, kept: list[int], seed: int = 0, window: int = 8) -> EagleHead:
    torch.manual_seed(seed)
    config = EagleConfig(model.config.hidden_size, model.config.vocab_size, len(kept), num_heads=2,
                         intermediate_size=48, window=window, target="tiny")
    return EagleHead(config, torch.tensor(kept)).eval()


def drafter_for(name: str, model):
    """(target backend, drafter) for each drafter, on a tiny target."""
    if name == "model":
        return HFCausalLM(model), ModelDrafter(HFCausalLM(noisy_copy(model, 0.3)))
    if name == "ngram":
        return HFCausalLM(model), NGramDrafter(model.config.vocab_size)
    if name in ("early-exit", "layer-skip"):
        backend = HFLayeredCausalLM(model)
        options = {"exit_layer": 1} if name == "early-exit" else {"skip": [1]}
        return backend, make_drafter(name, backend, **options)
    backend = HFCausalLM(model, keep_hidden=True)
    kept = list(range(model.config.vocab_size))
    if name == "heads":
        return backend, HeadsDrafter(backend, random_heads(model, 2, kept))
    return backend, EagleDrafter(backend, random_head(model, kept))


class BatchRounding:
    """A backend whose multi-token passes perturb the logits a little, by position: a stand-in for
    batched kernels that round differently from one-token steps (one-token steps stay exact)."""

    def __init__(self, backend, scale):
        self.backend, self.scale = backend, scale

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, tokens, num_logits=0, **kwargs):
        start = len(self.backend.tokens)
        logits = self.backend.forward(tokens, num_logits, **kwargs)
        if len(tokens) == 1:
            return logits
        rows = torch.arange(start + len(tokens) - logits.shape[0], start + len(tokens), dtype=torch.float32)
        wobble = torch.sin(rows[:, None] * 1.7 + torch.arange(logits.shape[1]) * 2.3)  # [rows, V]
        return logits + self.scale * wobble


class _Unsure:
    """The model as its own draft, with fixed noise on its logits (a function of the row's last
    token), so that its top token is often wrong and the target keeps other branches."""

    def __init__(self, model, scale: float = 4.0) -> None:
        self.model, self.scale = model, scale

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, num_logits=0, **tree):
        rows = self.model.forward(tokens, num_logits, **tree)  # [rows, V]
        last = list(tokens)[len(tokens) - rows.shape[0]:]
        noise = torch.stack([torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(t)) for t in last])
        return rows + self.scale * noise


# ----------------------------------------------------------------------------------------------
# Model files: a tiny GGUF, a pack of it, the installed smollm2 pack


def add_byte_tokenizer(w) -> int:
    """A byte-level BPE tokenizer of 261 tokens (the 256 bytes, three merges, two control tokens:
    end of text, the last, and padding) in the GGUF writer ``w``. Returns the vocabulary size."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>"]
    vocab = len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_eos_token_id(vocab - 1)
    w.add_pad_token_id(vocab - 2)
    w.add_bos_token_id(vocab - 2)
    w.add_add_bos_token(False)
    return vocab


def write_tiny_gguf(path: Path, *, tie: bool = True, seed: int = 0) -> None:
    """A 2-layer qwen2 GGUF with a byte-level BPE tokenizer (261 tokens), random float32 weights."""
    import gguf

    vocab, hidden, heads, kv_heads, ffn = TINY_VOCAB, 32, 4, 2, 64
    kv = kv_heads * hidden // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    assert add_byte_tokenizer(w) == vocab

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in [("attn_q", hidden, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden)]:
            tensor(f"blk.{i}.{name}.weight", rows, cols)
            tensor(f"blk.{i}.{name}.bias", rows)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not tie:
        tensor("output.weight", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


TINY_VOCAB = 261


def make_fake_pack(root: Path, monkeypatch, *, name: str = "tiny-pack", chunks: int = 3, tie: bool = True) -> Pack:
    """Split a tiny GGUF into ``chunks`` packages ``fake_tiny_partN`` under ``root/site``.

    The packages go on sys.path and the pack into :data:`packs.PACKS` for the test's duration.
    """
    gguf_path = root / "whole.gguf"
    write_tiny_gguf(gguf_path, tie=tie)
    data = gguf_path.read_bytes()
    site = root / "site"
    step = -(-len(data) // chunks)
    parts = []
    for i in range(1, chunks + 1):
        piece = data[(i - 1) * step : i * step]
        module = f"fake_{name.replace('-', '_')}_part{i}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("raise ImportError('chunk packages are never imported')\n")
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(piece)
        parts.append(Part(f"fake-{name}-part{i}", "0.1.0", module, f"data/part{i:02d}.bin", len(piece),
                          hashlib.sha256(piece).hexdigest()))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    pack = Pack(name, "a tiny test model", tuple(parts), len(data), hashlib.sha256(data).hexdigest(),
                vocab_size=TINY_VOCAB, eos_token_ids=(TINY_VOCAB - 1,))
    monkeypatch.setitem(packs.PACKS, name, pack)
    return pack


PACK = "smollm2-135m"
# Token ids of some English and code text in SmolLM2's vocabulary (any ids would do).
CONTEXT = [504, 1070, 28, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30, 3158, 314, 260, 1345, 30, 4667, 30]


def _gguf():
    if not llamacpp.available():
        pytest.skip(f"the llama.cpp binding is not installed: {llamacpp.INSTALL}")
    missing = packs.missing_parts(packs.PACKS[PACK])
    if missing:
        pytest.skip(f"pack {PACK} is not installed: {packs.PACKS[PACK].install_command(missing)}")
    return packs.gguf_file(PACK, progress=False)


# ----------------------------------------------------------------------------------------------
# The command line, run in-process


def first_layers_gguf(source: Path, dest: Path, layers: int) -> Path:
    """A copy of the GGUF ``source`` with only its first ``layers`` blocks (``block_count`` set to
    match): the same tokenizer, embedding, output head and tensor types, byte for byte, in a fraction
    of the compute. For the llama.cpp backend's tests of its own mechanics (batch invariance, trees,
    the cache), which hold or fail alike at any depth."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dest), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@lru_cache(maxsize=None)
def smollm2_first_layers(layers: int = 6) -> Path:
    """The installed SmolLM2 pack's GGUF cut to its first ``layers`` blocks (:func:`first_layers_gguf`),
    written once per process into a folder removed at exit (skipped as :func:`_gguf` is)."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="specdec-smollm2-"))
    atexit.register(shutil.rmtree, folder, True)
    return first_layers_gguf(_gguf(), folder / f"smollm2-first-{layers}-layers.gguf", layers)


def smollm2_llamacpp(layers: int | None = None) -> Any:
    """A fresh llama.cpp context of the installed SmolLM2 GGUF (its first ``layers`` blocks where given:
    :func:`smollm2_first_layers`), as the llama.cpp tests load it: the worker's threads, 512 cells, the
    repacked prefill layout (skipped as :func:`_gguf` is)."""
    path = _gguf() if layers is None else smollm2_first_layers(layers)
    return llamacpp.load_gguf(path, n_threads=THREADS, n_ctx=512, prefill_layout="repacked")


def load_pair_arguments(args, monkeypatch) -> dict:
    """The keyword arguments the command line parsed as ``args`` passes to
    :func:`specdec.models.load_pair` (which is stopped there: nothing loads)."""
    from specdec import models
    from specdec.cli import common

    seen: dict = {}

    def load_pair(target, draft, **kwargs):
        seen.update(kwargs)
        raise models.ModelPackError("stop here", "a test")

    monkeypatch.setattr(models, "load_pair", load_pair)
    try:
        common.load_models_from(args)
    except common.CLIError as err:
        assert "stop here" in str(err.message)
    return seen


def run_main(args, capsys):
    code = cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *, contains: str = "") -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 2, err
    assert lines[0].startswith("specdec: error: ") and lines[1].startswith("hint: ")
    assert contains in lines[0]


# ----------------------------------------------------------------------------------------------
# The server, in a thread


class Server:
    """uvicorn on 127.0.0.1 in a thread, on a port the OS picked; a context manager."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def engine(self) -> Any:
        return self.app.state.specdec.engine

    def client(self, key: str = "unused") -> openai.OpenAI:
        import httpx
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60,
                             http_client=httpx.Client(trust_env=False))


def serve(target: Any, tokenizer: Any, draft: Any = None, **options: Any) -> Server:
    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair
    from specdec.server.requests import method_config

    method = options.pop("method", "spec:model:block:k=4:policy=static" if draft is not None else "ar")
    served = Pair(target, tokenizer, draft, target_name="tiny", draft_name="tiny-draft" if draft is not None else None)
    return Server(create_app(served, ServerOptions(method_config(method, True), **options)))


def sse_events(response: httpx.Response) -> list[Any]:
    """The data of each server-sent event (parsed JSON, or the string [DONE])."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@contextlib.contextmanager
def running_stream(server: Server, max_tokens: int = 480) -> Iterator[httpx.Response]:
    """A streaming request that is generating (its first chunk has arrived) until the block ends,
    when the client disconnects."""
    import httpx

    body = {"prompt": "0", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(trust_env=False, timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            yield response


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# ----------------------------------------------------------------------------------------------
# Sampled output laws: the exact law of a tiny target and a chi-square test against it


PROMPT = [1, 2, 3]
SAMPLES = 4000
SIGNIFICANCE = 1e-3  # per test; a correct engine fails one of four such tests with prob. <= 0.4%
HORIZON = 3


def exact_target_law(model, sampling: SamplingConfig, vocab: int) -> np.ndarray:
    """P(first HORIZON tokens) under the target, by enumerating every prefix through the model."""
    law = np.zeros([vocab] * HORIZON)
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=HORIZON):
            logits = model(torch.tensor([PROMPT + list(seq[:-1])])).logits[0, len(PROMPT) - 1 :]
            probs = logits_to_probs(logits.double(), sampling).numpy()  # [HORIZON, V]
            law[seq] = np.prod([probs[t, seq[t]] for t in range(HORIZON)])
    return law


def chi_square_p_value(counts: np.ndarray, law: np.ndarray) -> float:
    """Pearson's test, pooling cells whose expected count is below 5 into one."""
    expected = law.ravel() * counts.sum()
    small = expected < 5
    obs = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        assert obs[-1] == 0, "a sequence of target probability 0 was generated"
        obs, exp = obs[:-1], exp[:-1]
    from scipy import stats as scipy_stats

    return float(scipy_stats.chisquare(obs, exp).pvalue)


def chi_square_power(law: np.ndarray, samples: int, effect: float) -> float:
    """Power of :func:`chi_square_p_value` at SIGNIFICANCE against a deviation of Cohen's w = effect."""
    from scipy import stats as scipy_stats

    cells = int((law.ravel() * samples >= 5).sum()) + 1
    critical = scipy_stats.chi2.ppf(1 - SIGNIFICANCE, cells - 1)
    return float(scipy_stats.ncx2.sf(critical, cells - 1, samples * effect**2))


class ContextLM:
    """A :class:`~specdec.backends.base.CausalLM` whose row for each token is ``model``'s logits of the
    token's whole context (the cached tokens it attends to, then itself), computed once per context
    and remembered. The law tests draw thousands of short generations from a tiny model over a
    handful of contexts: answered from memory each costs microseconds instead of a transformers pass,
    and its logits are those :func:`exact_target_law` enumerates, bit for bit. (The transformers
    backend's own cache, rollback and tree attention are checked against whole-context passes in
    test_engine.py and test_tree.py.)

    ``keep_hidden``: also keep each cached position's final normed hidden state (:attr:`hidden`, the
    LM head's input, taken from the same whole-context pass as the transformers backend takes it),
    for the drafters that read the target's features (heads, EAGLE)."""

    def __init__(self, model: Any, *, keep_hidden: bool = False) -> None:
        from specdec.backends.base import HIDDEN_STATES, TREES
        from specdec.backends.hf import final_norm

        self.model = model
        self._norm = final_norm(model) if keep_hidden else None
        self.capabilities = frozenset({TREES, HIDDEN_STATES} if keep_hidden else {TREES})
        self._tokens: list[int] = []
        self._states: list[torch.Tensor] = []  # [H] per cached position, when keep_hidden
        self._rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_context(self) -> int | None:
        return self.model.config.max_position_embeddings

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    @property
    def keeps_hidden(self) -> bool:
        return self._norm is not None

    @property
    def hidden(self) -> torch.Tensor:
        """[len(tokens), H]"""
        if self._norm is None:
            raise ValueError("this backend was built without keep_hidden=True")
        if not self._states:
            return torch.zeros(0, self.model.config.hidden_size, dtype=self.model.dtype)
        return torch.stack(self._states)

    def _row(self, context: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [V], hidden state [H] or None) of the context's last token."""
        if context not in self._rows:
            captured: list[torch.Tensor] = []
            hook = None if self._norm is None else self._norm.register_forward_hook(
                lambda _m, _a, out: captured.append(out[0, -1]))
            try:
                with torch.no_grad():
                    logits = self.model(torch.tensor([context])).logits[0, -1].float()  # [V]
            finally:
                if hook is not None:
                    hook.remove()
            self._rows[context] = (logits, captured[-1] if captured else None)
        return self._rows[context]

    def forward(self, tokens: Sequence[int], num_logits: int = 0, *, attend: torch.Tensor | None = None,
                positions: Sequence[int] | None = None) -> torch.Tensor:
        cached, seq = len(self._tokens), [*self._tokens, *tokens]
        rows = []
        for i in range(len(tokens)):
            seen = range(cached + i + 1) if attend is None else attend[i].nonzero().flatten().tolist()
            logits, state = self._row(tuple(seq[j] for j in seen))
            rows.append(logits)
            if self._norm is not None:
                self._states.append(state)
        self._tokens = seq
        out = torch.stack(rows)  # [len(tokens), V]
        return out[-num_logits:] if num_logits else out

    def keep(self, indices: Sequence[int]) -> None:
        self._tokens = [self._tokens[i] for i in indices]
        if self._norm is not None:
            self._states = [self._states[i] for i in indices]

    def trim(self, length: int) -> None:
        del self._tokens[length:]
        del self._states[length:]

    def reset(self) -> None:
        self._tokens, self._states = [], []


def assert_sampled_law(top_k: int = 0, **method) -> None:
    """The first HORIZON tokens of ``generate`` with ``method`` at T = 1 (and ``top_k``), over SAMPLES
    seeds, against the exact law of a 5-token target drafted by a noisy copy of it. Stated power:
    a deviation of Cohen's w = 0.15 (e.g. 7.5% of the mass moved between sequences) is detected
    with probability >= 0.95 at this sample size."""
    vocab = 5
    target = tiny_llama(0, vocab=vocab, sharpness=6.0)
    draft = noisy_copy(target, 0.5)
    law = exact_target_law(target, SamplingConfig(temperature=1.0, top_k=top_k), vocab)
    assert chi_square_power(law, SAMPLES, effect=0.15) >= 0.95
    counts = np.zeros_like(law)
    accepted = 0
    target_lm, draft_lm = ContextLM(target), ContextLM(draft)
    for seed in range(SAMPLES):
        r = generate(target_lm, PROMPT, draft=draft_lm, temperature=1.0, top_k=top_k, max_new_tokens=HORIZON,
                     seed=seed, eos_token_ids=[], **method)
        counts[tuple(r.token_ids)] += 1
        accepted += r.stats.accepted_tokens
    assert accepted > SAMPLES // 2  # drafts are really being accepted, not just resampled
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# Exact output laws of verification, over made-up distributions


Dist = Callable[[tuple[int, ...]], np.ndarray]  # context -> distribution over the vocabulary


def _rng_for(tag: str, context: tuple[int, ...]) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr((tag, context)).encode()))


def dirichlet(tag: str, vocab: int, zeros: int = 0) -> Dist:
    """A context-dependent random distribution; ``zeros`` tokens get probability 0 per context."""

    @lru_cache(maxsize=None)
    def dist(context: tuple[int, ...]) -> np.ndarray:
        rng = _rng_for(tag, context)
        d = rng.dirichlet(np.full(vocab, 0.7))
        if zeros:
            d[rng.choice(vocab, size=zeros, replace=False)] = 0.0
            if d.sum() == 0:
                d[rng.integers(vocab)] = 1.0
        return d / d.sum()

    return dist


def point_mass(tag: str, vocab: int) -> Dist:
    """A deterministic drafter (like n-gram lookup): all mass on one context-dependent token."""

    def dist(context: tuple[int, ...]) -> np.ndarray:
        d = np.zeros(vocab)
        d[_rng_for(tag, context).integers(vocab)] = 1.0
        return d

    return dist


def supported_on(tokens: list[int], tag: str, vocab: int) -> Dist:
    def dist(context: tuple[int, ...]) -> np.ndarray:
        d = np.zeros(vocab)
        d[tokens] = _rng_for(tag, context).dirichlet(np.ones(len(tokens)))
        return d

    return dist


def target_joint(p: Dist, vocab: int, horizon: int) -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(vocab), repeat=horizon):
        prob = 1.0
        for t in range(horizon):
            prob *= p(seq[:t])[seq[t]]
        joint[seq] = prob
    return joint


def outcomes(plan: VerifyPlan) -> list[tuple[int, int, float]]:
    """Every (n, y, probability) of a plan, rows normalised as the sampler normalises them."""
    result = []
    for n, pn in enumerate(plan.accept_len_probs.tolist()):
        if pn <= 0.0:
            continue
        row = plan.next_token_probs[n].double()
        row = row / row.sum()
        for y, py in enumerate(row.tolist()):
            if py > 0.0:
                result.append((n, y, pn * py))
    return result


def assert_same_law(a: dict, b: dict, tol: float = 1e-9) -> None:
    keys = set(a) | set(b)
    worst = max(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in keys)
    assert worst <= tol, f"laws differ by {worst:.3e}"
    assert abs(sum(a.values()) - 1.0) <= tol


def cases(vocab: int) -> dict[str, tuple[Dist, Dist]]:
    """name -> (target p, draft q) over ``vocab`` tokens."""
    half = vocab // 2
    return {
        "random": (dirichlet("p", vocab), dirichlet("q", vocab)),
        "draft-with-zeros": (dirichlet("p", vocab), dirichlet("q", vocab, zeros=vocab // 2)),
        "target-with-zeros": (dirichlet("p", vocab, zeros=vocab // 2), dirichlet("q", vocab)),
        "point-mass": (dirichlet("p", vocab), point_mass("q", vocab)),
        "equal": (dirichlet("p", vocab), dirichlet("p", vocab)),
        "disjoint": (
            supported_on(list(range(half)), "p", vocab),
            supported_on(list(range(half, vocab)), "q", vocab),
        ),
    }


def drafted_tree_joint(p: Dist, horizon: int, trees_at) -> dict:
    """The exact law of the output over ``horizon`` tokens when each step drafts a tree from
    ``trees_at(context, room)`` (pairs of probability and tree, at most ``room`` levels deep)
    and verifies it with :class:`TreeVerifier`."""
    verifier = TreeVerifier()
    mass = {(): 1.0}
    for length in range(horizon):
        for seq in [s for s in mass if len(s) == length]:
            weight = mass.pop(seq)
            for tree_prob, tree in trees_at(seq, horizon - length - 1):
                rows = [p(seq)] + [p(seq + tuple(tree.tokens[i] for i in tree.path(n))) for n in range(len(tree))]
                plan = verifier.plan_tree(tree, torch.tensor(np.array(rows)))
                for end, y, prob in outcomes(plan):
                    out = seq + tuple(tree.tokens[i] for i in tree.path(end - 1)) + (y,)
                    mass[out] = mass.get(out, 0.0) + weight * tree_prob * prob
    return mass


def orderings(dist: np.ndarray, width: int) -> list[tuple[tuple[int, ...], float]]:
    """Every ordered draw of min(width, support) tokens from ``dist`` without replacement, with its probability."""
    support = [t for t in range(len(dist)) if dist[t] > 0]
    result = []
    for seq in itertools.permutations(support, min(width, len(support))):
        prob, left = 1.0, 1.0
        for t in seq:
            prob *= dist[t] / left
            left -= dist[t]
        result.append((seq, prob))
    return result


# ----------------------------------------------------------------------------------------------
# The planner's made-up costs, and ar's output to compare with


ROWS = range(1, 17)
CHEAP_ROWS = CostModel([1.0 + 0.05 * (n - 1) for n in ROWS], draft=0.05)  # memory-bound: rows nearly free
DEAR_ROWS = CostModel([0.9 * n for n in ROWS], draft=0.05)  # compute-bound: every row a full step
# On the edge: one draft token pays at alpha = 0.6 (the prior), not after a rejection (alpha = 0.40).
EDGE_ROWS = CostModel([1.0 + 0.4 * (n - 1) for n in ROWS], draft=0.0)


def ar_tokens(model, prompt, n: int) -> list[int]:
    steps = autoregressive_steps(HFCausalLM(model), prompt, sampling=SamplingConfig(), max_new_tokens=n)
    return [t for s in steps for t in s.tokens]
