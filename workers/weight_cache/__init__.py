"""The preload weight cache: daemons that hold processed weights, and the engine side that maps them.

`fingerprint.py` says which weights a rank needs, `arena.py` packs tensors into shared memory (CPU) or
IPC handles (CUDA), `daemon.py` is one cache process per (role, DP rank, TP rank), `client.py` is the
engine's `ipc_cache` loader, and `preload.py` is the `ember preload` launcher.
"""
