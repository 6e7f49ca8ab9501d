"""``specdec serve`` against hostile or broken clients, on a tiny model over loopback only.

Bad text (lone surrogates), oversized bodies and prompts, slow or malformed connections, foreign
``Host`` headers, the API key kept out of ``ps``, and ``Retry-After`` on 429. Every error must be
OpenAI's JSON with the right status and ``param``; every test is bounded to a few seconds.
"""

from __future__ import annotations

import contextlib
import base64
import hashlib
import json
import re
import select
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from specdec.server.requests import method_config
from specdec.server.app import ServerOptions, create_app
from specdec.models import Pair
from helpers import Server, running_stream, tiny_pair, tiny_tokenizer, wait_for

LOOPBACK = "127.0.0.1"


# ------------------------------------------------------------------------------------------------
# Servers, raw connections and responses


class GuardedServer(Server):
    """As test_server's, with uvicorn configured as ``specdec serve`` configures it."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from specdec.server.guard import uvicorn_config

        super().__init__(app)
        config = uvicorn_config(app, app.state.specdec.options, log_level="warning", access_log=False, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)


class RecordingTokenizer:
    """A tokenizer that notes the longest text it was given and, for text holding ``SLOW``, takes
    ``delay`` seconds (as a huge prompt would)."""

    def __init__(self, inner: Any, delay: float = 0.0) -> None:
        self.inner, self.delay, self.longest = inner, delay, 0
        self.working = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _saw(self, text: str) -> None:
        self.longest = max(self.longest, len(text))
        if "SLOW" in text:
            self.working.set()
            time.sleep(self.delay)

    def __call__(self, text: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            self._saw(text)
        return self.inner(text, **kwargs)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        self._saw("".join(m["content"] for m in messages))
        return self.inner.apply_chat_template(messages, **kwargs)


@pytest.fixture(scope="module")
def pair():
    target, draft = tiny_pair()
    return target, draft, tiny_tokenizer()


def app_of(pair: Any, tokenizer: Any = None, **options: Any) -> Any:
    target, draft, default_tokenizer = pair
    served = Pair(target, tokenizer or default_tokenizer, draft, target_name="tiny", draft_name="tiny-draft")
    return create_app(served, ServerOptions(method_config(options.pop("method", "spec:model:block:k=4:policy=static"), True), **options))


@pytest.fixture(scope="module")
def server(pair):
    with Server(app_of(pair)) as running:
        yield running


@pytest.fixture(scope="module")
def guarded(pair):
    """A server whose clients have one second to send their headers, and again their body."""
    with GuardedServer(app_of(pair, read_timeout=1.0)) as running:
        yield running


def post(server: Server, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json",
                      **kwargs.pop("headers", {})}, trust_env=False, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                 words: str = "") -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and error["code"] == code and words in error["message"], error
    return error


def exchange(port: int, pieces: list[bytes], gap: float = 0.0, limit: float = 6.0) -> tuple[bytes, float]:
    """Send ``pieces`` on a fresh loopback connection, ``gap`` seconds apart, stopping once the
    server answers or closes; then read until it closes. Returns what came back and the seconds
    from connecting to the close (``limit`` at most)."""
    start = time.monotonic()
    with socket.create_connection((LOOPBACK, port), timeout=limit) as sock:
        for piece in pieces:
            with contextlib.suppress(OSError):
                sock.sendall(piece)
            if select.select([sock], [], [], gap)[0] or time.monotonic() - start > limit:
                break
        got = b""
        with contextlib.suppress(OSError):
            while time.monotonic() - start < limit:
                sock.settimeout(max(0.05, limit - (time.monotonic() - start)))
                data = sock.recv(65536)
                if not data:
                    break
                got += data
    return got, time.monotonic() - start


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers (lower-case names) and body of one HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0].startswith("HTTP/1.1 "), raw[:200]
    headers = dict((k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def assert_raw_error(raw: bytes, status: int, code: str | None = None) -> dict[str, Any]:
    got, headers, body = parse(raw)
    assert got == status, raw[:300]
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and error["message"], error
    return error


def request_head(method: str = "POST", path: str = "/v1/completions", host: str = LOOPBACK, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# ------------------------------------------------------------------------------------------------
# Text that is not Unicode


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ab\\udc00"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ab", "suffix": "x\\ud800", "max_tokens": 2}', "suffix"),
    ("/v1/completions", '{"prompt": "ab", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ab\\ud800cd"}]}', "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}, '
                             '{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages.1.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}',
     "messages.0.name"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    assert_error(post(server, path, body), 400, param, words="lone surrogate")


def test_a_field_named_by_a_lone_surrogate_is_a_400(server):
    assert_error(post(server, "/v1/completions", '{"prompt": "ab", "\\ud800": 1}'), 400, None,
                 words="field name holds a lone surrogate")


# ------------------------------------------------------------------------------------------------
# Big bodies and prompts


def test_a_body_over_the_limit_is_a_413_before_it_is_read(pair):
    with GuardedServer(app_of(pair)) as running:  # the default limit: a few MB
        limit = running.app.state.specdec.options.max_body_bytes
        assert 1 << 20 <= limit <= 16 << 20
        raw, seconds = exchange(running.port, [request_head(content_type="application/json",
                                                            content_length=str(10 * 10**6))])
        error = assert_raw_error(raw, 413, code="body_too_large")
        assert str(limit) in error["message"] and seconds < 3
        assert parse(raw)[1]["connection"] == "close"


def test_a_body_over_a_set_limit_is_a_413_with_or_without_content_length(pair):
    with Server(app_of(pair, max_body_bytes=1000)) as running:
        body = json.dumps({"prompt": "x" * 2000, "max_tokens": 2})
        assert_error(post(running, "/v1/completions", body), 413, code="body_too_large", words="1000 bytes")
        chunked = post(running, "/v1/completions", iter([body[:900].encode(), body[900:].encode()]))
        assert_error(chunked, 413, code="body_too_large")
        fits = post(running, "/v1/completions", {"prompt": "x" * 500, "max_tokens": 2, "temperature": 0})
        assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a" * 100_000, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "a" * 60_000, "suffix": "b" * 60_000, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 50_000}] * 2}, "messages"),
])
def test_a_prompt_with_more_characters_than_the_context_holds_is_refused_before_tokenizing(pair, path, body, param):
    tokenizer = RecordingTokenizer(tiny_tokenizer())
    with Server(app_of(pair, tokenizer)) as running:
        error = assert_error(post(running, path, body), 400, param, words="characters")
    assert "512" in error["message"]  # the tiny model's context
    assert tokenizer.longest < 10_000


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a" * 600, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [65] * 600, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600}]}, "messages"),
])
def test_a_prompt_with_more_tokens_than_the_context_holds_is_a_400_naming_it(server, path, body, param):
    assert_error(post(server, path, body), 400, param, words="context holds 512")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "SLOW", "max_tokens": 2, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 2, "temperature": 0}),
])
def test_tokenizing_does_not_hold_up_other_requests(pair, path, body):
    tokenizer = RecordingTokenizer(tiny_tokenizer(), delay=2.0)
    with Server(app_of(pair, tokenizer)) as running:
        answers: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: answers.append(post(running, path, body)))
        slow.start()
        assert tokenizer.working.wait(10)
        start = time.monotonic()
        health = httpx.get(running.url + "/health", trust_env=False, timeout=10)
        waited = time.monotonic() - start
        slow.join(30)
    assert health.status_code == 200 and waited < 1.0, waited
    assert answers[0].status_code == 200, answers[0].text


# ------------------------------------------------------------------------------------------------
# Errors that name their field


@pytest.mark.parametrize("extra, param, words", [
    ({"seed": 2**64}, "seed", "seed"),
    ({"seed": -1}, "seed", "seed"),
    ({"prompt": [1, 2, 100000]}, "prompt", "outside the vocabulary"),
    ({"speculative": {"method": "spec:ngram:block:max_ngram=abc"}}, "speculative.method", "max_ngram"),
    ({"speculative": {"method": "spec:ngram:block:min_ngram=1.5"}}, "speculative.method", "min_ngram"),
    ({"speculative": {"method": "spec:tree:depth=deep"}}, "speculative.method", "depth"),
    ({"speculative": {"method": "spec:model:block:k=99999999999999999999999"}}, "speculative.method", "k="),
    ({"speculative": {"method": "spec:model:block:k_max=99999999999999999999999"}}, "speculative.method", "k_max"),
    ({"speculative": {"method": "spec:model:tree:width=99999999999999999999999"}}, "speculative.method", "width"),
    ({"speculative": "spec:tree"}, "speculative", '{"method": '),
    ({"speculative": ["spec:tree"]}, "speculative", '{"method": '),
])
def test_errors_name_their_field(server, extra, param, words):
    error = assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **extra}), 400, param,
                         words=words)
    assert "not supported between" not in error["message"] and "JSON object" not in error["message"]
    if param == "speculative.method":
        assert "integer" in error["message"], error


def test_a_malformed_content_length_gets_a_json_400(guarded):
    raw, _ = exchange(guarded.port, [request_head(content_length="-5") + b"{}"])
    assert_raw_error(raw, 400, code="invalid_http")


def test_a_malformed_request_line_gets_a_json_400(guarded):
    raw, _ = exchange(guarded.port, [b"GET /\x00 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"])
    assert_raw_error(raw, 400, code="invalid_http")


# ------------------------------------------------------------------------------------------------
# Slow and oversized requests


def test_headers_dribbled_past_the_read_timeout_get_a_408_and_the_connection_closes(guarded):
    lines = [b"POST /v1/completions HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n"] + [b"X-Slow: 1\r\n"] * 40
    raw, seconds = exchange(guarded.port, lines, gap=0.2)
    assert seconds < 3.0, seconds
    assert_raw_error(raw, 408, code="timeout")


def test_a_silent_connection_is_closed_after_the_read_timeout(guarded):
    raw, seconds = exchange(guarded.port, [b""], gap=0.0)
    assert raw == b"" and seconds < 3.0, (raw, seconds)


def test_a_body_dribbled_past_the_read_timeout_gets_a_408(guarded):
    head = request_head(content_type="application/json", content_length="400")
    raw, seconds = exchange(guarded.port, [head] + [b" "] * 40, gap=0.2)
    assert seconds < 3.0, seconds
    assert_raw_error(raw, 408, code="timeout")


def test_a_keep_alive_connection_gets_the_read_timeout_again_for_its_next_request(guarded):
    first = request_head("GET", "/health")
    raw, seconds = exchange(guarded.port, [first, b"GET /health HTTP/1.1\r\n"] + [b"X-Slow: 1\r\n"] * 40, gap=0.2)
    assert raw.startswith(b"HTTP/1.1 200") and seconds < 3.0, (raw[:100], seconds)


def test_a_100_kb_header_is_refused_with_a_json_431(guarded):
    raw, seconds = exchange(guarded.port, [request_head("GET", "/health", x_big="a" * 100_000)])
    assert_raw_error(raw, 431, code="headers_too_large")
    assert seconds < 3.0


def test_ordinary_requests_still_work_on_the_guarded_server(guarded):
    got = post(guarded, "/v1/completions", {"prompt": "x", "max_tokens": 3, "temperature": 0})
    assert got.status_code == 200 and got.json()["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------------------------
# Host names and browser headers


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/v1/models/", "/", "/nowhere"])
def test_a_foreign_host_gets_a_400_before_anything_else(pair, path):
    with Server(app_of(pair, api_key="s3cret")) as running:
        response = httpx.get(running.url + path, headers={"Host": "evil.example"}, trust_env=False)
    assert_error(response, 400, code="invalid_host")
    assert "location" not in response.headers and "evil.example" not in response.text


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:{port}", "localhost:{port}", "LOCALHOST", "[::1]:{port}",
                                  "[::1]"])
def test_the_loopback_names_are_accepted(server, host):
    response = httpx.get(server.url + "/health", headers={"Host": host.format(port=server.port)}, trust_env=False)
    assert response.status_code == 200, response.text


def test_allowed_hosts_follow_the_bound_address_and_the_option():
    from specdec.server.guard import allowed_hosts

    assert allowed_hosts("127.0.0.1") == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_hosts("::1") == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_hosts("localhost") == {"localhost", "127.0.0.1", "[::1]"}
    assert allowed_hosts("0.0.0.0") is None and allowed_hosts("::") is None  # every host
    assert allowed_hosts("192.168.1.5") == {"192.168.1.5"}
    assert allowed_hosts("127.0.0.1", "box.lan, Other.Example") == {"localhost", "127.0.0.1", "[::1]", "box.lan",
                                                                    "other.example"}
    assert allowed_hosts("127.0.0.1", "*") is None


def test_allowed_hosts_admit_their_names(pair):
    from specdec.server.guard import allowed_hosts

    with Server(app_of(pair, allowed_hosts=allowed_hosts("127.0.0.1", "box.lan"))) as running:
        for host, status in [("box.lan", 200), (f"box.lan:{running.port}", 200), ("localhost", 200),
                             ("evil.example", 400)]:
            assert httpx.get(running.url + "/health", headers={"Host": host}, trust_env=False).status_code == status
    with Server(app_of(pair, allowed_hosts=None)) as running:
        assert httpx.get(running.url + "/health", headers={"Host": "any.example"}, trust_env=False).status_code == 200


def test_the_page_forbids_framing_sniffing_and_foreign_scripts(server):
    page = httpx.get(server.url + "/", trust_env=False)
    assert page.status_code == 200
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["x-frame-options"] == "DENY"
    policy = dict(part.strip().split(" ", 1) for part in page.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert policy["connect-src"] == "'self'"
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page.text, re.S)
        assert blocks, tag
        for block in blocks:  # every inline block is allowed by its hash, and nothing else is
            digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
            assert f"'sha256-{digest}'" in policy[directive].split()
    assert "unsafe-inline" not in policy.get("script-src", "")
    assert not re.search(r"\sstyle=|\son[a-z]+=", page.text)  # no inline attributes the policy would block
    assert httpx.get(server.url + "/health", trust_env=False).headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(server.url + "/nowhere", trust_env=False)
    assert missing.status_code == 404 and missing.headers["x-content-type-options"] == "nosniff"


# ------------------------------------------------------------------------------------------------
# The API key from a file


def test_the_api_key_is_read_from_a_file(tmp_path):
    import argparse

    from specdec.cli.serve import api_key

    path = tmp_path / "key"
    path.write_text("  s3cret \nnot this line\n")
    assert api_key(argparse.Namespace(api_key=None, api_key_file=str(path))) == "s3cret"
    assert api_key(argparse.Namespace(api_key="given", api_key_file=None)) == "given"


@pytest.mark.parametrize("content, words", [(None, "cannot read"), ("", "is empty"), ("\n\nkey\n", "is empty")])
def test_a_missing_or_empty_api_key_file_is_refused_before_loading(capsys, tmp_path, content, words):
    from specdec import cli

    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    code = cli.main(["serve", "--target", "/nonexistent-model-dir", "--api-key-file", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "--api-key-file" in err and words in err and "Traceback" not in err, err


def test_serve_help_says_how_to_keep_the_key_out_of_ps(capsys):
    from specdec import cli

    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--api-key-file" in text and re.search(r"\bps\b", text) and "SPECDEC_API_KEY" in text


# ------------------------------------------------------------------------------------------------
# Retry-After on 429


def test_a_full_queue_answers_429_with_retry_after(pair):
    with Server(app_of(pair, max_queue=0)) as running:
        running.engine.durations.extend([2.2, 2.6])  # the recent generations took 2.4 s on average
        with running_stream(running):
            response = post(running, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert_error(response, 429, code="queue_full")
        assert response.headers["retry-after"] == "3"  # one generation ahead, 2.4 s, rounded up
        wait_for(lambda: len(running.engine.history) == 1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_past_the_engines_limits_mid_generation_is_a_400_naming_its_field(server, monkeypatch, stream):
    """A grammar that passed the check at its first tokens can still reach one of llguidance's limits
    as the output grows (the processor raises ConstraintError then): the request's fault, a 400 naming
    the field, never a 500; a stream ends with that error after the tokens it sent. The server serves on."""
    from specdec.api import _Run
    from specdec.constraints import ConstraintError

    real = _Run.events

    def grows_past_a_limit(run: Any) -> Any:  # the run's events, as the serving engine reads them
        events = real(run)
        for i, event in enumerate(events):
            if i == 2:
                events.close()
                raise ConstraintError("regex", "is too large for the grammar engine: (a limit)")
            yield event

    monkeypatch.setattr(_Run, "events", grows_past_a_limit)
    body = {"prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": stream}
    r = post(server, "/v1/completions", body)
    if stream:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3  # the steps it sent, then the error
        error = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 400
        error = r.json()["error"]
    assert error["param"] == "regex" and "too large for the grammar engine" in error["message"]
    assert "generated tokens" in error["message"]
    monkeypatch.undo()
    assert post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------------
# Malformed bodies and the fields errors name


def nested(depth: int, inner: str = "0") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("depth", [129, 2000, 10000])
def test_deeply_nested_json_is_a_400_not_a_500(server, depth):
    """Arrays nested thousands deep (4-20 KB) overflow a recursive parser's stack; any body nested
    deeper than MAX_JSON_DEPTH is malformed for this API, said in OpenAI's shape."""
    from specdec.server.requests import MAX_JSON_DEPTH

    for body in (nested(depth), '{"prompt": "x", "stop": ' + nested(depth - 1) + "}"):
        assert_error(post(server, "/v1/completions", body), 400, words=f"more than {MAX_JSON_DEPTH} levels deep")
    assert post(server, "/v1/completions", {"prompt": "abc", "max_tokens": 2}).status_code == 200  # serves on


def test_nesting_up_to_the_limit_is_read_as_usual(server):
    from specdec.server.requests import MAX_JSON_DEPTH

    body = '{"prompt": "x", "stop": ' + nested(MAX_JSON_DEPTH - 1, '"a"') + "}"  # the body's object is a level
    assert_error(post(server, "/v1/completions", body), 400, "stop", words="stop must be")


@pytest.mark.parametrize("field, value", [
    ("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"), ("presence_penalty", "-Infinity"),
    ("repeat_penalty", "NaN"),
])
def test_a_number_that_is_not_finite_is_told_so(server, field, value):
    """JSON as Python reads it spells NaN and Infinity; a NaN temperature is not "more than 2"."""
    body = '{"prompt": "x", "max_tokens": 2, "%s": %s}' % (field, value)
    error = assert_error(post(server, "/v1/completions", body), 400, field, words="finite number")
    assert "less than" not in error["message"] and "greater than" not in error["message"]


def test_a_logit_bias_that_is_not_finite_names_its_token(server):
    assert_error(post(server, "/v1/completions", '{"prompt": "x", "logit_bias": {"5": NaN}}'), 400, "logit_bias.5",
                 words="finite number")


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": 5}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"json_schema": "an object"}, "json_schema"),
    ("/v1/chat/completions", {"tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function"}}, "tool_choice.function"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name"),
])
def test_param_is_the_requests_own_field_path(server, path, extra, param):
    """pydantic names the member of a union it tried (``dict[str,any]``, ``literal[...]``, a class
    name) in its error locations; ``param`` is the path of the field in the request."""
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    error = assert_error(post(server, path, {**body, **extra}), 400, param)
    assert error["message"].startswith(param + ": ")


@pytest.mark.parametrize("backend, method, words", [
    ("plain", "spec:early-exit", "the early-exit drafter needs a target backend that can run a subset of its layers"),
    ("plain", "spec:heads", "the heads drafter needs a target backend that can keep its hidden states"),
    ("plain", "spec:layer-skip", "the layer-skip drafter needs"),
    ("transformers", "spec:heads", "no draft heads ship for this target"),
    ("transformers", "spec:early-exit:exit_layer=99", "exit_layer must be in 1..1"),
])
def test_a_method_that_cannot_be_built_names_speculative_method(pair, backend, method, words):
    """A drafter the target's backend cannot feed (layers, hidden states: on the GGUF kernel or
    llama.cpp; here a transformers model on the plain backend), or whose options or files do not
    fit the target, is the request's method's fault: a 400 naming the field, and the server serves on."""
    from specdec.backends.hf import HFCausalLM

    target, draft, tokenizer = pair
    served = (HFCausalLM(target) if backend == "plain" else target, draft, tokenizer)
    with Server(app_of(served)) as running:
        for stream in (False, True):
            error = assert_error(post(running, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": stream,
                                                                   "speculative": {"method": method}}),
                                 400, "speculative.method", words=words)
            assert error["message"].startswith(f"speculative.method: {method.split(':')[0]}:{method.split(':')[1]}")
        assert post(running, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200
