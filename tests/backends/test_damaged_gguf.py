"""A GGUF file whose tensor data is damaged (1 MB of 0xFF bytes: NaN scales) makes the model compute
non-finite logits. Decoding must stop there with an error naming the file, never "generate" blank
text: the command line in one line and a hint with a non-zero exit, the Python API with
:class:`specdec.NonFiniteLogitsError`, the server with an error answer for that request while it
serves on, one request at a time or several (``--parallel``)."""

from __future__ import annotations

import shutil

import httpx
import pytest

import specdec
from specdec import DecodeConfig, generate, generate_many, models, packs
from specdec.models import Pair
from specdec.server.app import ServerOptions, create_app
from specdec.server.requests import method_config

from helpers import THREADS, Server, run_main

SMOLLM2 = "smollm2-135m"
DAMAGE = 1 << 20  # bytes of 0xFF written into the tensor data


def smollm2_gguf():
    missing = packs.missing_parts(packs.PACKS[SMOLLM2])
    if missing:
        pytest.skip(f"pack {SMOLLM2} is not installed: {packs.PACKS[SMOLLM2].install_command(missing)}")
    return packs.PACKS[SMOLLM2].parts[0].locate()


def damage(root, where: str):
    """A copy of the SmolLM2 pack's GGUF with 1 MB of 0xFF written into its tensor data, from the
    start of the tensor ``where`` (its offset read with the gguf reader) on."""
    from gguf import GGUFReader

    path = root / "smollm2-damaged.gguf"
    shutil.copyfile(smollm2_gguf(), path)
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == where)
    with open(path, "r+b") as f:
        f.seek(int(tensor.data_offset))
        f.write(b"\xff" * DAMAGE)
    return path


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """Damage from the start of the tensor data: the token embeddings, which the tied output head
    also reads (the target's logits hold NaNs)."""
    return damage(tmp_path_factory.mktemp("embeddings"), "token_embd.weight")


@pytest.fixture(scope="module")
def damaged_layer(tmp_path_factory):
    """Damage in the first layer's feed-forward weights: the hidden state turns NaN, and the kernel's
    head, which quantizes its input rows, would read it as zeros (finite logits) unless the backend
    says the row is not finite."""
    return damage(tmp_path_factory.mktemp("layer"), "blk.0.ffn_down.weight")


def test_the_command_line_stops_with_one_line_naming_the_file(damaged, capsys):
    code, out, err = run_main(["generate", "--target", str(damaged), "--draft", "none", "--max-new-tokens", "8",
                               "--temperature", "0", "def fibonacci(n):"], capsys)
    assert code == 1 and out == "", (code, out, err)
    assert "Traceback" not in err
    error, hint = err.strip().splitlines()[-2:]  # after the notes on what loads
    assert error.startswith("specdec: error: ") and str(damaged) in error and "non-finite logits" in error, err
    assert hint.startswith("hint: ") and "sha256" in hint


@pytest.mark.parametrize("which", ["embeddings", "layer"])
@pytest.mark.parametrize("method", ["ar", "spec"])
def test_the_api_raises_the_exported_error_naming_the_file(damaged, damaged_layer, which, method):
    path = damaged if which == "embeddings" else damaged_layer
    target, tokenizer = models.load(str(path), backend="gguf", n_threads=THREADS)
    draft = target.fork() if method == "spec" else None
    config = DecodeConfig.parse(method).replace(temperature=0, max_new_tokens=8)
    with pytest.raises(specdec.NonFiniteLogitsError) as caught:
        generate(target, "def fibonacci(n):", draft=draft, tokenizer=tokenizer, config=config)
    assert caught.value.source == str(path) and str(path) in str(caught.value)
    assert caught.value.position == len(tokenizer("def fibonacci(n):")["input_ids"])  # at the first step


def test_generate_many_raises_it_too(damaged):
    target, tokenizer = models.load(str(damaged), backend="gguf", n_threads=THREADS)
    with pytest.raises(specdec.NonFiniteLogitsError, match="non-finite logits"):
        generate_many(target, ["a", "b"], tokenizer=tokenizer, max_new_tokens=4, temperature=0)


def served(pair: Pair, parallel: int) -> Server:
    app = create_app(Pair(pair.target, pair.tokenizer, pair.draft, target_name="damaged", draft_name="damaged",
                          backend="gguf"), ServerOptions(method_config("spec", True), parallel=parallel))
    return Server(app)


@pytest.mark.parametrize("parallel", [1, 2])
def test_the_server_answers_an_error_for_the_request_and_serves_on(damaged, parallel):
    pair = models.load_pair(str(damaged), str(damaged), backend="gguf", n_threads=THREADS)
    with served(pair, parallel) as server, httpx.Client(trust_env=False, timeout=120) as http:
        for stream in (False, True, False):  # the server is still up after each
            r = http.post(server.url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 6,
                                                                 "temperature": 0, "stream": stream})
            assert r.status_code == 503 and r.headers["content-type"].startswith("application/json"), r.text
            error = r.json()["error"]
            assert error["code"] == "model_error" and "smollm2-damaged.gguf" in error["message"], error
            assert "non-finite logits" in error["message"] and str(damaged.parent) not in error["message"]
        assert http.get(server.url + "/health").status_code == 200
        metrics = http.get(server.url + "/metrics").text
        assert 'specdec_requests_total{endpoint="/v1/completions",outcome="error"} 3.0' in metrics



@pytest.mark.parametrize("method", ["ar", "spec"])
def test_a_transformers_model_with_nan_weights_stops_the_same_way(method):
    """The check is the decode loop's, whatever the backend: a transformers target whose weights
    hold a NaN stops at its first step, named by its folder."""
    import torch

    from tiny import noisy_copy, tiny_llama

    target = tiny_llama(0, vocab=16, sharpness=10.0)
    draft = noisy_copy(target, 0.3) if method == "spec" else None
    target.config._name_or_path = "/models/tiny-damaged"
    with torch.no_grad():
        next(p for name, p in target.named_parameters() if "mlp" in name).view(-1)[0] = float("nan")
    with pytest.raises(specdec.NonFiniteLogitsError, match="^/models/tiny-damaged: .* after 3 tokens"):
        generate(target, [1, 2, 3], draft=draft, max_new_tokens=4)
