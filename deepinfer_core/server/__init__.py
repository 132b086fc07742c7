"""The OpenAI- and Anthropic-compatible HTTP server (the `serve` extra: FastAPI + uvicorn).

`deepinfer serve MODEL` runs it; `serve.BackgroundServer` runs it on a thread for tests and
benchmarks. Importing this package imports no web framework; `app` does.
"""
