"""The gateway as an HTTP server facing the internet (issue #37), as a real `pipeshard serve-openai`
process in front of the scripted coordinator: body limit, integer ranges, invalid JSON, 404/405 in
OpenAI's shape, slow headers closed, and API keys (a revoked key refused while it runs)."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx2 as httpx
import pytest

from pipeshard.keys import add_key, revoke_key

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def gateway(gateways) -> str:
    return gateways("--header-timeout-s", "1")


def error_of(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def raw_exchange(address: str, headers: bytes) -> tuple[int, dict]:
    """A chat request of these headers and no body; the status and error of the reply, read until
    the gateway closes the connection."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_body_over_the_limit_is_413_without_being_read(gateway):
    with httpx.Client(base_url=f"http://{gateway}", timeout=30) as http:
        # declared: refused on the header, before a byte of it is sent
        status, error = raw_exchange(gateway, f"Content-Length: {9 * 2**20}\r\n".encode())
        assert status == 413 and "over the limit of 8388608 bytes" in error["message"]

        def chunks():  # no Content-Length: counted as it streams
            for _ in range(40):
                yield b" " * 2**18

        streamed = http.post("/v1/chat/completions", content=chunks())
        assert error_of(streamed, 413)["code"] == "request_too_large"
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"n": 2**31}, "n"),
        ({"n": -1}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_integers_out_of_range_are_400_naming_the_parameter(gateway, extra, param):
    reply = httpx.post(f"http://{gateway}/v1/chat/completions", json={**CHAT, **extra}, timeout=30)
    assert error_of(reply, 400)["param"] == param


def test_invalid_json_404_and_405_answer_in_openai_shape(gateway):
    with httpx.Client(base_url=f"http://{gateway}", timeout=30) as http:
        bad = http.post("/v1/chat/completions", content=b'{"model": "m", "messages": [', headers=JSON)
        error = error_of(bad, 400)
        assert error["code"] == "invalid_json" and error["param"] is None
        assert "not valid JSON" in error["message"]
        assert error_of(http.get("/v1/nowhere"), 404)["type"] == "not_found_error"
        wrong = http.get("/v1/chat/completions")
        assert "method not allowed" in error_of(wrong, 405)["message"] and wrong.headers["allow"] == "POST"


def test_a_connection_sending_headers_slowly_is_closed(gateway):
    host, port = gateway.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        closed = False
        for i in range(100):  # a header line every 0.2 s would go on for 20 s
            readable, _, _ = select.select([sock], [], [], 0.2)
            if readable:
                try:
                    closed = sock.recv(1024) == b""
                except ConnectionResetError:  # closed while a header line was in flight: a reset
                    closed = True
                break
            try:
                sock.sendall(f"x-slow-{i}: 1\r\n".encode())
            except OSError:
                closed = True
                break
        assert closed


def test_keys_are_checked_at_the_gateway_and_forwarded(gateways, coordinator, tmp_path):
    keys = tmp_path / "api-keys"
    alice, bob = add_key(keys, "alice"), add_key(keys, "bob")
    address = gateways("--api-keys", str(keys))

    def post(key: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"http://{address}/v1/chat/completions", json=CHAT, headers=headers, timeout=30)

    for key in (None, "invented", alice + "x"):
        assert error_of(post(key), 401)["code"] == "invalid_api_key"
    assert post(alice).status_code == 200
    assert coordinator[0].metadata[-1]["authorization"] == f"Bearer {alice}"  # the coordinator's to check
    assert httpx.get(f"http://{address}/health", timeout=30).status_code == 200  # probes need no key
    revoke_key(keys, "alice")
    time.sleep(0.6)  # the key file is checked for changes at most every 0.5 s
    assert error_of(post(alice), 401)["code"] == "invalid_api_key"
    assert post(bob).status_code == 200
    assert json.loads(post(bob).text)["choices"][0]["message"]["content"] == "Hello world"


def test_metrics_name_only_known_paths(gateways):
    """A path taken from the URL as a label would let a caller grow /metrics without end: the
    invented ones are all counted as `other`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = gateways("--metrics-port", str(port))
    for i in range(5):
        assert httpx.post(f"http://{address}/v1/chat/completions-{i}", json=CHAT).status_code == 404
    assert httpx.post(f"http://{address}/v1/completions/x", json=CHAT).status_code == 404
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'pipeshard_gateway_requests_total{path="other",status="404"} 6.0' in text, text
    assert "completions-" not in text and "completions/x" not in text
