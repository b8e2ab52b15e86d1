"""`ember snapshot create/restore/inspect`: CRIU checkpoints of a fully initialized `ember serve`.

`commands` runs the three subcommands, `manifest` records what an image was made from and checks the
host, `criu` is the world outside Ember (the CRIU binary, the namespaced launch, /proc). The canary,
the one request whose answer must survive a checkpoint and restore, is `frontend.canary` (the parked
server answers it too).
"""
