"""Text in and out, shared by every way in (HTTP server, batch mode, the offline `LLM`).

Chat templates, the OpenAI request and response schemas, prompt rendering, image intake,
incremental detokenization with stop strings, tool and reasoning parsers, and the output processor
that turns engine deltas into results (`outputs`: the user-facing result types). The tokenizer
itself is in the shared base (`coreproc.base.tokenizer`: the workers use it too). Runs in the
frontend or the caller's process; nothing here imports torch.
"""
