"""Starting the server: `deepinfer serve MODEL` in the foreground, or `BackgroundServer` on a
thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from typing_extensions import Self

from deepinfer_core.server.limits import ServerLimits
from deepinfer_core.server.state import ServerState

__all__ = ["BackgroundServer", "ServeExtraMissing", "bind_socket", "build_server_app", "run_serve_command", "serve"]


class ServeExtraMissing(ImportError):
    """FastAPI or uvicorn is not installed."""


def build_server_app(llm: Any, model_name: str, limits: ServerLimits) -> Any:
    from deepinfer_core.server.app import build_app

    return build_app(ServerState.build(llm, model_name, limits))


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(llm: Any, *, model_name: str, host: str, port: int, limits: ServerLimits) -> None:
    _require_serve_extra()
    import uvicorn

    app = build_server_app(llm, model_name, limits)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


class BackgroundServer:
    """The server on a free loopback port, on a thread; `with BackgroundServer(llm) as server:`
    then talk to `server.base_url`."""

    def __init__(self, llm: Any, *, model_name: str = "deepinfer", limits: ServerLimits | None = None,
                 startup_timeout_s: float = 60.0) -> None:
        import uvicorn

        self.app = build_server_app(llm, model_name, limits or ServerLimits())
        self._socket = bind_socket("127.0.0.1", 0)
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="deepinfer-http", daemon=True)
        self._startup_timeout_s = startup_timeout_s

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {self._startup_timeout_s} s")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


def run_serve_command(args: Any) -> int:
    """`deepinfer serve`: build the engine from the parsed arguments and serve until interrupted."""
    from deepinfer_core import LLM

    _require_serve_extra()
    limits = ServerLimits(api_key=args.api_key, max_tokens=args.max_tokens_limit,
                          max_request_bytes=args.max_request_bytes)
    llm = LLM(args.model, accelerator=args.accelerator, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              num_kv_blocks=args.num_kv_blocks, kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
              fp8_activations=args.fp8_activations, seed=args.seed)
    serve(llm, model_name=args.served_model_name or llm.checkpoint_dir.name, host=args.host, port=args.port,
          limits=limits)
    return 0


def _require_serve_extra() -> None:
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise ServeExtraMissing(f"the server needs {' and '.join(missing)}: pip install 'deepinfer[serve]'")
