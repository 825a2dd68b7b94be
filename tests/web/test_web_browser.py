"""The playground, the dashboard and the API docs in real headless Chromium against a real server: a
streamed answer, Stop (the server frees the request), switching models, the API key field, the dashboard
under load, /docs and /redoc offline; no request leaves 127.0.0.1 and the console stays clean.
Screenshots go to test-artifacts/ ($PAGEDSERVE_TEST_ARTIFACTS)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.web.conftest import ALT, API_KEY, DEFAULT, running_now

pytestmark = pytest.mark.slow

ANSWER = ".message.assistant .content"
FIGURES = ".message.assistant .figures"


def assert_clean(watch) -> None:
    assert watch.errors == []
    assert watch.foreign_requests() == []


def open_playground(watch, server, key: str | None = API_KEY):
    page = watch.page
    page.goto(server.url + "/")
    if key is not None:
        page.get_by_label("API key").fill(key)
        page.get_by_label("API key").press("Tab")  # change -> the model list loads with the key
        page.wait_for_function("document.getElementById('model').options.length > 0")
    return page


def wait_until(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_playground_streams_an_answer_with_figures(watched_page, web_server):
    page = open_playground(watched_page, web_server)
    assert page.get_by_label("Model").input_value() == DEFAULT
    page.get_by_label("Max tokens").fill("120")
    message = page.get_by_label("Message")
    message.fill("Write a poem about the sea.")
    message.press("Shift+Enter")  # a newline, not a send
    assert message.input_value() == "Write a poem about the sea.\n"
    assert page.locator(".message").count() == 0
    message.type("Give it a title.")
    message.press("Enter")
    page.wait_for_function(f"document.querySelector('{ANSWER}')?.textContent.length > 0")
    first = page.locator(ANSWER).inner_text()
    page.wait_for_function(
        f"document.querySelector('{ANSWER}').textContent.length > {len(first) + 10}"
        " || document.getElementById('stop').disabled"
    )
    grown = page.locator(ANSWER).inner_text()
    assert len(grown) > len(first)  # the text arrived in pieces, not at once
    watched_page.screenshot("playground-mid-answer")
    page.wait_for_function("document.getElementById('stop').disabled")
    figures = page.locator(FIGURES).inner_text()
    assert figures.startswith(DEFAULT)
    assert "TTFT" in figures and "tokens" in figures and "finish:" in figures
    assert page.locator(".message.user .content").inner_text() == "Write a poem about the sea.\nGive it a title."
    watched_page.screenshot("playground-answered")
    assert_clean(watched_page)


def test_stop_aborts_the_request_and_the_server_frees_it(watched_page, web_server):
    before = web_server.get("/dashboard/stats").json()["finished"].get("abort", 0)
    page = open_playground(watched_page, web_server)
    # prompt + max tokens fit the 64 MiB KV cache in float32 too (1,280 tokens; a longer request gets a 400)
    page.get_by_label("Max tokens").fill("1000")
    page.get_by_label("Seed").fill("7")
    page.get_by_label("Message").fill("Tell me a very long story about a dragon and a knight, in many chapters.")
    page.get_by_role("button", name="Send").click()
    page.wait_for_function(f"document.querySelector('{ANSWER}')?.textContent.length > 20")
    assert running_now(web_server) == 1
    page.get_by_role("button", name="Stop").click()
    page.wait_for_function("document.getElementById('send').disabled === false")
    assert "stopped" in page.locator(FIGURES).inner_text()
    wait_until(lambda: running_now(web_server) == 0, what="the server to drop the stopped request")

    def freed() -> bool:  # the dashboard's next sample: counted as aborted, its blocks back in the pool
        stats = web_server.get("/dashboard/stats").json()
        return stats["finished"].get("abort", 0) == before + 1 and all(p["used"] == 0 for p in stats["block_pools"])

    wait_until(freed, what="the abort to be counted and the blocks freed")
    assert_clean(watched_page)


def test_switching_the_model(watched_page, web_server):
    page = open_playground(watched_page, web_server)
    options = page.locator("#model option").all_inner_texts()
    assert set(options) >= {DEFAULT, ALT}
    page.get_by_label("Model").select_option(ALT)
    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Message").fill("Hello!")
    page.get_by_label("Message").press("Enter")
    page.wait_for_function("document.getElementById('stop').disabled && document.querySelector('.figures')")
    page.wait_for_function(f"document.querySelector('{FIGURES}').textContent.includes('tokens')")
    assert page.locator(FIGURES).inner_text().startswith(ALT + " ")
    assert_clean(watched_page)


def test_api_key_field_and_a_readable_error_without_it(watched_page, web_server):
    page = open_playground(watched_page, web_server, key=None)
    key_field = page.get_by_label("API key")
    assert key_field.is_visible()
    alert = page.get_by_role("alert")
    alert.wait_for()
    assert "API key" in alert.inner_text()
    assert page.locator("#model option").count() == 0
    key_field.fill("sk-wrong")
    key_field.press("Tab")
    page.wait_for_function("document.getElementById('error').textContent.includes('401')")
    assert "API key" in alert.inner_text()
    key_field.fill(API_KEY)
    key_field.press("Tab")
    page.wait_for_function("document.getElementById('model').options.length > 0")
    assert alert.is_hidden()
    assert page.evaluate("sessionStorage.getItem('pagedserve.apiKey')") == API_KEY
    page.reload()  # the key survives a reload of the tab
    page.wait_for_function("document.getElementById('model').options.length > 0")
    assert page.get_by_label("API key").input_value() == API_KEY
    assert watched_page.foreign_requests() == []
    assert [e for e in watched_page.errors if "401" not in e] == []  # only the wrong key's refused call


def test_markdown_from_the_model_cannot_inject_html(watched_page, web_server):
    page = open_playground(watched_page, web_server)
    hostile = (
        '# Title <img src=x onerror="window.pwned=1">\n\n**bold** and `<script>window.pwned=2</script>`\n\n'
        "- [link](javascript:window.pwned=3)\n- [ok](https://example.org/a)\n\n```html\n<iframe src=x></iframe>\n```"
    )
    result = page.evaluate(
        """(text) => {
            const box = document.createElement('div');
            document.body.appendChild(box);
            window.renderMarkdown(text, box);
            return {
                injected: box.querySelectorAll('img, script, iframe').length,
                hrefs: [...box.querySelectorAll('a')].map((a) => a.href),
                strong: box.querySelector('strong')?.textContent,
                text: box.textContent,
                pwned: window.pwned || null,
            };
        }""",
        hostile,
    )
    assert result["injected"] == 0 and result["pwned"] is None
    assert result["hrefs"] == ["https://example.org/a"]
    assert result["strong"] == "bold"
    assert '<img src=x onerror="window.pwned=1">' in result["text"]  # shown as text
    assert "<iframe src=x></iframe>" in result["text"]
    assert_clean(watched_page)


def _load(server, stop: threading.Event, errors: list) -> None:
    body = {"model": DEFAULT, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
    with httpx.Client(headers=server.headers(), timeout=120.0) as client:
        while not stop.is_set():
            try:
                client.post(server.base_url + "/completions", json=body).raise_for_status()
            except httpx.HTTPError as exc:
                errors.append(exc)
                return


def test_dashboard_follows_the_load(watched_page, web_server):
    page = watched_page.page
    page.goto(web_server.url + "/dashboard")
    page.wait_for_function("document.getElementById('running').textContent !== '–'")
    finished_before = int(page.locator('td[data-reason="length"]').inner_text())
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(web_server, stop, errors)) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        page.wait_for_function("Number(document.getElementById('running').textContent) > 0")
        page.wait_for_function("Number(document.getElementById('generation-tps').textContent) > 0")
        page.wait_for_function(
            f"Number(document.querySelector('td[data-reason=\"length\"]').textContent) > {finished_before}"
        )
        page.wait_for_function("document.getElementById('ttft').textContent.split(' / ')[0] !== '–'")
        caption = page.locator(".pool-caption").first.inner_text()
        assert "blocks" in caption and "in use" in caption
        watched_page.screenshot("dashboard-under-load")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    page.wait_for_function("Number(document.getElementById('running').textContent) === 0")
    assert page.locator(".pool-caption").count() == 2  # one pool per served model
    assert_clean(watched_page)


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_render_offline(watched_page, web_server, path):
    page = watched_page.page
    page.goto(web_server.url + path)
    page.get_by_text("/v1/chat/completions").first.wait_for()
    watched_page.screenshot("api-docs" + path.replace("/", "-"))
    assert_clean(watched_page)
