"""`ember bench`: throughput, latency, restart and serving-load benchmarks (figures, never asserts).

Each module adds its subcommand's arguments and runs it in the user's shell process; `serve` load-tests
any OpenAI-compatible server over HTTP, the others build Ember engines themselves.
"""
