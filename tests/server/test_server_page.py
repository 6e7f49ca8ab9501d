"""The page at ``GET /`` in a real headless browser: Debian's Chromium, driven by Playwright.

A prompt streams in, each step's text is coloured by where it came from (a draft token the target
accepted, or the target's own), and the figures shown agree with the stream; each test saves a
screenshot. Skipped, with the command that fixes it, when Chromium or Playwright is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from pathlib import Path

import httpx
import pytest

from specdec import generate, models, packs
from helpers import Server, serve, tiny_pair, tiny_tokenizer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs Playwright: pip install playwright")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # as root (CI containers) Chromium's sandbox cannot start; the page is our own, on loopback
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        yield launched
        launched.close()


def page_url(server: Server, **params: object) -> str:
    return f"{server.url}/?{urllib.parse.urlencode(params)}"


def streamed_steps(server: Server, body: dict, key: str | None = None) -> list[dict]:
    """The stream's chunks that carry tokens, read directly (what the page should show)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    chunks = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      trust_env=False, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                if chunk["speculative"].get("token_ids"):
                    chunks.append(chunk)
    return chunks


def run_page(browser, url: str, screenshot: Path, prompt: str | None = None, timeout_s: float = 60) -> object:
    page = browser.new_page(viewport={"width": 1100, "height": 720})
    page.goto(url)
    if prompt is not None:  # type and click, as a person would
        page.fill("#prompt", prompt)
        page.click("#go")
    page.wait_for_selector('#status[data-state="done"]', timeout=timeout_s * 1000)
    page.screenshot(path=str(screenshot), full_page=True)
    return page


def check_page_against_stream(page, steps: list[dict], prompt: str) -> None:
    shown = page.text_content("#out")
    assert shown == prompt + "".join(c["choices"][0]["text"] for c in steps)
    drafts = page.locator("#out .draft").all_text_contents()
    assert drafts == [c["choices"][0]["text"][:c["speculative"]["draft_chars"]] for c in steps
                      if c["speculative"]["draft_chars"] > 0]
    assert page.locator("#out .step").count() == len(steps)  # one per target forward
    tokens = sum(len(c["speculative"]["token_ids"]) for c in steps)
    drafted = sum(c["speculative"]["drafted"] for c in steps)
    accepted = sum(sum(c["speculative"]["from_draft"]) for c in steps)
    assert page.inner_text("#s-tokens") == str(tokens)
    assert page.inner_text("#s-tpf") == f"{tokens / len(steps):.2f}"
    assert page.inner_text("#s-acc") == f"{100 * accepted / drafted:.0f}%"
    assert page.inner_text("#s-tps") != "–" and page.inner_text("#s-ttft").endswith(" s")


def test_page_streams_a_prompt_and_colours_draft_tokens(browser, tmp_path):
    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    prompt = "def quicksort(arr):"
    with serve(target, tokenizer, draft) as running:
        steps = streamed_steps(running, {"prompt": prompt, "max_tokens": 64, "temperature": 0})
        page = run_page(browser, page_url(running, prompt=prompt, max_tokens=64, temperature=0, autorun=1),
                        tmp_path / "server-page.png")
    assert "".join(c["choices"][0]["text"] for c in steps) == generate(
        target, prompt, draft=draft, tokenizer=tokenizer, max_new_tokens=64, policy="static").text
    assert page.locator("#out .draft").count() > 0 and page.locator("#out .target").count() > 0
    check_page_against_stream(page, steps, prompt)
    assert (tmp_path / "server-page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nscreenshot: {tmp_path / 'server-page.png'}")


def test_page_typed_prompt_with_an_api_key_and_a_chosen_method(browser, tmp_path):
    target, draft = tiny_pair()
    tokenizer = tiny_tokenizer()
    with serve(target, tokenizer, draft, api_key="k3y") as running:
        body = {"prompt": "while True:", "max_tokens": 24, "temperature": 0,
                "speculative": {"method": "spec:model:token:k=2:policy=static"}}
        steps = streamed_steps(running, body, key="k3y")
        page = browser.new_page()
        page.goto(page_url(running, key="k3y"))
        page.fill("#prompt", "while True:")
        page.fill("#max_tokens", "24")
        page.fill("#method", "spec:model:token:k=2:policy=static")
        page.click("#go")
        page.wait_for_selector('#status[data-state="done"]', timeout=60_000)
        page.screenshot(path=str(tmp_path / "typed.png"))
        check_page_against_stream(page, steps, "while True:")
        assert "spec:model:token:k=2:policy=static" in page.inner_text("#model")
        page.fill("#method", "spec:nope")  # an error is shown, not swallowed
        page.click("#go")
        page.wait_for_selector('#status[data-state="error"]', timeout=60_000)
        assert "unknown verifier" in page.inner_text("#error")


@pytest.mark.slow
def test_page_with_smollm2(browser, tmp_path):
    """SmolLM2-135M drafted by its own int8 copy: the picture in docs/server.md."""
    pack = packs.PACKS["smollm2-135m"]
    missing = packs.missing_parts(pack)
    if missing:
        pytest.skip(f"pack smollm2-135m is not installed: {pack.install_command(missing)}")
    from specdec.server.requests import method_config
    from specdec.server.app import ServerOptions, create_app
    from specdec.models import Pair

    target, tokenizer = models.load("smollm2-135m")
    served = Pair(target, tokenizer, target, target_name="smollm2-135m", draft_name="smollm2-135m (int8)")
    prompt = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    with Server(create_app(served, ServerOptions(method_config("spec:model:block:k=4:policy=static", True)))) as running:
        steps = streamed_steps(running, {"prompt": prompt, "max_tokens": 96, "temperature": 0})
        page = run_page(browser, page_url(running, prompt=prompt, max_tokens=96, temperature=0, autorun=1),
                        tmp_path / "server-page.png", timeout_s=300)
    check_page_against_stream(page, steps, prompt)
    print(f"\nscreenshot: {tmp_path / 'server-page.png'}")
