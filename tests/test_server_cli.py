"""`deepinfer serve MODEL` starts a server on the port it is given, which answers, and stops on SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deepinfer_core.server.serve import bind_socket
from tests.server_fixtures import MODEL

httpx = pytest.importorskip("httpx", reason="the server tests talk raw HTTP through httpx")


def test_serve_command_answers_on_its_port(tiny_checkpoint):
    probe = bind_socket("127.0.0.1", 0)
    port = probe.getsockname()[1]
    probe.close()  # NOTE: another process could take the port before the server binds it; unlikely on loopback
    command = [sys.executable, "-m", "deepinfer_core.cli", "serve", str(tiny_checkpoint), "--port", str(port),
               "--accelerator", "cpu", "--num-kv-blocks", "32", "--max-num-seqs", "4",
               "--served-model-name", MODEL, "--max-tokens-limit", "16"]
    server = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up within 120 s"
            time.sleep(0.25)
        answer = httpx.post(f"{base}/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] >= 1
        too_many = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "x", "max_tokens": 17})
        assert too_many.status_code == 400 and "limit" in too_many.text
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
    assert server.returncode in (0, -15)
