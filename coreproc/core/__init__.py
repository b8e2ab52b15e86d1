"""The core process (`ember-core`): the scheduler loop and what it drives.

`server` serves clients over ZeroMQ; `engine` is one step as a named sequence over `scheduler` and an
`executor` (workers in-process, spawned, on other nodes, or Ray actors). The scheduler's pieces:
requests, the waiting queue, paged KV bookkeeping with prefix caching, step plans, pipeline
micro-batches, speculation and its n-gram proposer, LoRA and image stores. No torch here; this code
imports the shared base and never the caller's side (`coreproc.client`, `coreproc.text`).
"""
