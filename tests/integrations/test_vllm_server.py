"""kvtier's offloading spec inside vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server --kv-transfer-config ...``), over HTTP on loopback: two chat
requests share a long system prompt; between them vLLM's own prefix cache is reset, so the second
request's cached tokens come from kvtier's host tier, and the server's metrics say so."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from vllm_testlib import ROOT, SPEC, child_env, needs_vllm, write_tiny_model

pytestmark = [needs_vllm, pytest.mark.slow]

SYSTEM = " ".join(["the kv cache tier keeps each prefix page of the host and the disk"] * 12)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 120) -> str:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    port = _free_port()
    kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {**SPEC, "host_gb": 0.01}}
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--block-size", "32", "--max-model-len", "512",
         "--enforce-eager", "--num-gpu-blocks-override", "200", "--enable-prompt-tokens-details",
         "--kv-transfer-config", json.dumps(kv)],
        stdout=log, stderr=subprocess.STDOUT, env=child_env(VLLM_SERVER_DEV_MODE="1"), cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}); see {log.name}"
            try:
                _http(url + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, f"the server did not come up in 240 s; see {log.name}"
                time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _chat(url: str, question: str) -> dict:
    body = {"model": json.loads(_http(url + "/v1/models"))["data"][0]["id"],
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0}
    return json.loads(_http(url + "/v1/chat/completions", body))


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``, from /metrics."""
    total = 0.0
    for line in _http(url + "/metrics").splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_two_chat_requests_sharing_a_prefix_hit_kvtiers_host_tier(server):
    first = _chat(server, "hello")
    assert first["usage"]["prompt_tokens"] > 64
    _http(server + "/reset_prefix_cache", {})  # vLLM's own cache forgets the system prompt
    second = _chat(server, "world")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and cached % 32 == 0
    deadline = time.monotonic() + 30  # the engine's stats reach the server's registry a step later
    while _metric(server, "vllm:kv_offload_kvtier_hit_chunks_total", tier="host") < cached // 32:
        assert time.monotonic() < deadline, _http(server + "/metrics")[-3000:]
        time.sleep(0.5)
    assert _metric(server, "vllm:prompt_tokens_cached_by_source_total", source="host") == cached
    assert _metric(server, "vllm:kv_offload_kvtier_hit_chunks_total", tier="host") == cached // 32
    assert _metric(server, "vllm:kv_offload_kvtier_stored_chunks_total") >= cached // 32
