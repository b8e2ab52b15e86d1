"""Convert a Hugging Face checkpoint to GGUF with llama.cpp's own `convert_hf_to_gguf.py`.

Usage: `python convert_gguf.py LLAMA_CPP_SRC MODEL_DIR --outfile X.gguf --outtype bf16`. Runs the converter
of the given llama.cpp source tree (with its vendored gguf-py) in this process, after declaring the
checkpoint's byte-level BPE tokenizer GPT-2 style: the converter recognises pre-tokenizers only by a
hash of known models' tokenizations and refuses ours ("BPE pre-tokenizer was not recognized"). Without
a `tokenizer.model` file, its sentencepiece attempt is skipped (as it would be with sentencepiece installed).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    src, rest = Path(argv[0]).resolve(), argv[1:]
    sys.path.insert(0, str(src / "gguf-py"))
    sys.path.insert(0, str(src))
    import convert_hf_to_gguf  # noqa: PLC0415  (from the llama.cpp source tree)
    from conversion import base  # noqa: PLC0415

    def gpt2_pre_tokenizer(self: object, tokenizer: object) -> str:
        return "gpt-2"

    def no_sentencepiece(self: object) -> None:
        raise FileNotFoundError("no tokenizer.model")

    base.TextModel.get_vocab_base_pre = gpt2_pre_tokenizer
    if not (Path(rest[0]) / "tokenizer.model").is_file():
        # the Llama converter tries sentencepiece first and needs the module only to find no file
        base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    sys.argv = ["convert_hf_to_gguf.py", *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
