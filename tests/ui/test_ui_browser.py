"""The gateway's /ui page in a real headless Chromium (selenium) before a real 2-stage fleet with
API keys: the key entered once, a prompt's answer seen growing while it streams and equal token for
token to the API's, every stage in the fleet view. `make test-ui` (Debian's chromium and
chromium-driver); PIPESHARD_UI_SCREENSHOTS=docs/img also refreshes the page's pictures in docs."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import openai
import pytest

from pipeshard.keys import add_key
from pipeshard.services.launcher import start_fleet
from pipeshard.topology import Endpoint, Topology

pytestmark = [pytest.mark.slow, pytest.mark.ui]

MODEL = "smollm2-135m-instruct"
PROMPT = "Write a short poem about the sea and the wind."
TOKENS = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoint(address: str, metrics_port: int) -> Endpoint:
    host, port = address.rsplit(":", 1)
    return Endpoint(host=host, port=int(port), metrics_port=metrics_port)


@pytest.fixture(scope="module")
def fleet(smollm2_export, tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-fleet")
    keys = root / "api-keys"
    key = add_key(keys, "browser")
    topology = root / "topology.yaml"
    metrics = {name: _free_port() for name in ("stage0", "stage1", "coordinator")}
    shards = smollm2_export(2, "int4")
    started = start_fleet(
        shards,
        2,
        root / "run",
        gateway_port=0,
        metrics_ports=metrics,
        extra_gateway_args=["--api-keys", str(keys), "--topology", str(topology)],
    )
    try:
        Topology(
            shards=str(shards),
            coordinator=_endpoint(started.coordinator, metrics["coordinator"]),
            exporter=_endpoint("127.0.0.1:1", 0),
            stages=[_endpoint(a, metrics[f"stage{k}"]) for k, a in enumerate(started.stages)],
        ).save(topology)
        yield started, key
    finally:
        started.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert binary and driver, (
        "no chromium: apt-get install -y chromium chromium-driver (make test-ui says so)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield chrome
    finally:
        chrome.quit()


def _until(what, timeout_s: float = 60.0, every_s: float = 0.05):
    """``what()``'s first truthy value, polled; fails naming the wait after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if value := what():
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what.__doc__ or what}")


def _screenshot(element, tmp_path: Path, name: str) -> None:
    """The page (a driver) or one element of it, as ui-NAME.png."""
    path = tmp_path / f"ui-{name}.png"
    element.save_screenshot(str(path)) if hasattr(element, "save_screenshot") else element.screenshot(
        str(path)
    )
    if folder := os.environ.get("PIPESHARD_UI_SCREENSHOTS"):
        shutil.copyfile(path, Path(folder) / path.name)


def test_a_prompt_streams_its_answer_and_the_fleet_view_shows_every_stage(fleet, browser, tmp_path):
    from selenium.webdriver.common.by import By

    started, key = fleet
    find = browser.find_element
    browser.get(f"http://{started.gateway}/")  # redirects to /ui
    assert browser.current_url.endswith("/ui")

    def refused():
        """the fleet view to say it needs the key"""
        return "API key" in find(By.ID, "fleet-error").text

    _until(refused)
    find(By.ID, "key").send_keys(key)
    find(By.ID, "save-key").click()

    def stages():
        """both stages serving in the fleet view"""
        rows = browser.find_elements(By.CSS_SELECTOR, "#stages tr")
        cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
        return (
            cells if [c[0] for c in cells] == ["0", "1"] and all(c[4] == "serving" for c in cells) else None
        )

    cells = _until(stages)
    assert [(c[2], c[3]) for c in cells] == [(started.stages[0], "0-14"), (started.stages[1], "15-29")]
    assert all("invariant" in c[5] and c[9].endswith("MiB") for c in cells), cells
    assert find(By.CSS_SELECTOR, '#model dd[data-field="layers"]').text == "30"

    max_tokens = find(By.ID, "max_tokens")
    max_tokens.clear()
    max_tokens.send_keys(str(TOKENS))
    find(By.ID, "prompt").send_keys(PROMPT)
    find(By.ID, "send").click()
    seen: list[str] = []

    def finished():
        """the streamed answer to finish"""
        text = browser.execute_script(
            'const a = document.getElementById("answer"); return a && a.textContent;'
        )
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        errors = browser.find_elements(By.CSS_SELECTOR, "#log .msg.error")
        assert not errors, errors[0].text
        return "tokens in" in find(By.ID, "status").text

    _until(finished, timeout_s=180)
    answer = browser.execute_script('return document.getElementById("answer").textContent;')
    assert len(seen) >= 3 and all(answer.startswith(part) for part in seen), seen  # it grew while streaming
    _screenshot(browser, tmp_path, "chat")

    # Token for token the API's greedy answer to the same message (the page trims nothing).
    with openai.OpenAI(base_url=f"http://{started.gateway}/v1", api_key=key, max_retries=0) as api:
        expected = api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=TOKENS, temperature=0
        )
    assert answer == expected.choices[0].message.content
    assert f"{expected.usage.completion_tokens} tokens in" in find(By.ID, "status").text

    def live():
        """the coordinator's finished calls in the fleet view"""
        return "OK" in find(By.CSS_SELECTOR, '#coordinators td[data-field="Generate calls"]').text

    _until(live)
    _screenshot(find(By.ID, "fleet"), tmp_path, "fleet")
