"""The shared base: what every layer and every process may import (and it imports nothing above it).

Configuration (`config`, `model_config`, `parallel_config`, `options`, `limits`), the wire messages
(`protocol`) and their transports (`ipc`, `channel`), errors, what the host is (`host`), the GGUF
file reader, LoRA manifests, the logits-processor interface, the tokenizer, and the start-up pieces
every process runs (`boot`, `orphan`, `trace`, `standby`). No torch at import time; `lint-imports`
keeps the rule: below `coreproc`, import only `coreproc.base`.
"""
