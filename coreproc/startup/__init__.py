"""Process start-up, in one place: who starts whom, and how each process comes up.

The process tree of `ember serve` (every name is the process title):

    ember (frontend: HTTP, tokenizer)          launcher.CoreProcess -> python -m coreproc.base.boot core
      └─ ember-core (scheduler, engine core)  spawn.spawn_worker   -> python -m coreproc.base.boot worker
           └─ ember-worker-<rank> ...

    ember-preload (`ember preload`, separate)  workers.weight_cache.preload
      ├─ ember-preload-<role>-dp<d>-tp<t> (weight-cache daemons, one per rank)
      └─ ember-zygote (zygote.py): every module imported, the preloaded tokenizer built; forks
           ├─ ember-serve     for `ember serve --load-format ipc_cache` (frontend.launch stands in)
           ├─ ember-core      for a frontend with --load-format ipc_cache (spawn.spawn_engine_process)
           ├─ ember-worker-<rank>  for such a core
           └─ ember-prepared  the next restart's worker, prepared (prepared.py; workers/prepared.py)

`ember core` runs the core in the user's process; the offline `LLM` and `ember batch` run the engine
core in-process (workers in-process or spawned as above). Here: `launcher` (start a core and wait
for its READY), `spawn` (a fresh interpreter or a fork of the zygote), `zygote` and `zygote_link`
(the light way to it, the `ember` launcher's), `forked` (what a forked child does first), `prepared`
(the next restart's worker) and `headless` (`ember worker --headless`). What every process runs as
it starts lives in the shared base, so that the workers may use it: `coreproc.base.boot` is the
first module of every fresh core or worker interpreter (garbage collector off before the heavy
imports; the role's `main` calls `boot.settle()` once up), `coreproc.base.orphan.LauncherWatch` ends
a core or worker whose launcher is gone until their serving loops watch it, `coreproc.base.standby`
starts a cold start's core and first worker before their command lines are known, and
`coreproc.base.trace` records the start-up phases. Modules here import no frontend code.
"""
