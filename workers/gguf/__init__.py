"""GGUF tensors in a worker: dequantized under Hugging Face names (`weights`, `dequant`), or repacked
in their own bits for the CPU integer-dot matmuls (`repack`). The file reader itself is shared
(`coreproc.base.gguf_file`)."""
