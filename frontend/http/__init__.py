"""The HTTP server of `ember serve`: the Starlette app, its routes and middleware, SSE, metrics.

`server` builds the app and runs it under uvicorn (`uvicorn_server`, `read_deadline`, `listen`);
`completions` answers one completion or chat request (streamed through `sse_chunks`); `processes`
runs several HTTP processes on one port; `settings` and `security` are the server's flags and their
checks; `openapi` the served schema; `metrics` the Prometheus page.
"""
