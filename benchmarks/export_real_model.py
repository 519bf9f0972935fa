"""A GGUF checkpoint as a plain transformers directory (safetensors in ``--dtype``, config,
generation config, tokenizer with its chat template), so that vLLM and FlashDec load the same
weights: vLLM reads a GGUF's Q4_1 blocks its own way, a directory the same way FlashDec does.

The GGUF is read by flashdec.models.real.load_gguf (transformers dequantizes every weight to
float; needs the ``gguf`` and ``accelerate`` packages), cast to ``--dtype`` and saved the way
flashdec.models.real.converted_dir saves its float32 copy (the GGUF quantizer mark dropped).

On the GPU machine (no registry; the file carried in parts, scripts/carry_parts.sh):
  python3 benchmarks/export_real_model.py /tmp/carry/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      /tmp/smollm2-bf16
Here: ``--gguf smollm2`` takes the installed built-in model's file.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("gguf", help="a .gguf file, or a built-in real model's name (smollm2)")
    p.add_argument("out", help="the directory to write (must not exist, or --force)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    return p.parse_args(argv)


def gguf_path(name_or_path: str) -> Path:
    """A built-in real model's file, or the path itself (ValueError when neither)."""
    from flashdec.models.real import REAL_MODELS, real_model_file

    if name_or_path in REAL_MODELS:
        return real_model_file(name_or_path)
    path = Path(name_or_path)
    if not path.is_file() or path.suffix != ".gguf":
        raise ValueError(f"{name_or_path!r} is neither a .gguf file nor {', '.join(REAL_MODELS)}")
    return path


def export(gguf: Path, out: Path, dtype: torch.dtype, *, force: bool = False) -> Path:
    """Write ``gguf``'s model and tokenizer to ``out`` (through a temporary sibling renamed
    into place: a reader never sees half a directory)."""
    from flashdec.models.real import load_gguf

    if out.exists() and not force:
        raise ValueError(f"{out} exists (pass --force to replace it)")
    model, tokenizer = load_gguf(gguf, dtype=dtype, device="cpu")
    model.hf_quantizer = None  # every weight is a plain float (load_gguf checked)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = export(gguf_path(args.gguf), Path(args.out), DTYPES[args.dtype], force=args.force)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
