"""Text in and out, shared by every way in (HTTP server, batch mode, the offline `LLM`).

The checkpoint's tokenizer and chat templates, the OpenAI request and response schemas, prompt
rendering, incremental detokenization with stop strings, and the output processor that turns engine
deltas into results. Runs in the frontend or the caller's process; nothing here imports torch.
"""
