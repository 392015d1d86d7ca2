"""GGUF copies of the benchmark checkpoints for the llama.cpp rows (only when llama-cpp-python is installed).

    python -m benchmarks.gguf CHECKPOINT_FOLDER TYPE      # TYPE: f32, f16, q8_0 or q4_0

F32, F16 and Q8_0 come from llama.cpp's own ``convert_hf_to_gguf.py``; Q4_0 from llama.cpp's quantizer
(``llama_model_quantize``, what ``llama-quantize`` runs) applied to the F32 file, so it is the Q4_0 a
llama.cpp user makes (its output matrix stays at a higher precision, as llama.cpp chooses). The converter
is not in llama-cpp-python's wheel: ``benchmarks/build_llama_cpp.sh`` keeps the one from the same sources
beside the wheel, where this module looks for it; ``LLAMA_CPP_CONVERT`` (the script) or ``LLAMA_CPP_DIR``
(a llama.cpp checkout) point elsewhere.

The checkpoints whose vocabulary is the benchmark's synthetic byte-level BPE (LFM2, Gemma 4) are not in the
converter's list of known tokenizers, which it recognises by hashing how they split a test text, and it
stops ("BPE pre-tokenizer was not recognized"). Their pre-tokenizer is GPT-2's byte-level split (see
``checkpoints._synthetic_tokenizer``), so the conversion declares it as llama.cpp's "gpt-2". So does the
shipped demo model's (a byte-level BPE whose split spells capitalised words letter by letter, which llama.cpp
has no pre-tokenizer for): its GGUF is for the rows that hand llama.cpp token ids (speed, context), and
would split text differently from mlxchat.

A checkpoint whose config declares multi-token-prediction layers (``mtp_num_hidden_layers``: Qwen3.5) is
converted without them (``--no-mtp``): mlxchat does not run them, the benchmark checkpoints (built by
transformers) hold no ``mtp.*`` weights, and llama.cpp refuses a file that counts those layers without
their tensors ("tensor 'blk.24.attn_norm.weight' not found").
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .checkpoints import HERE, MARKER

DEMO = HERE.parent / "core" / "demo" / "model"

GGUF_DIR = Path(os.environ.get("MLXCHAT_BENCH_GGUF", HERE / "gguf"))
TYPES = ("f32", "f16", "q8_0", "q4_0")
CONVERTED = ("f32", "f16", "q8_0")
"""Types the converter writes; the others are quantized from the F32 file."""
LLAMA_FTYPES = {"q4_0": 2}
"""llama_ftype values (llama.h: LLAMA_FTYPE_MOSTLY_Q4_0 = 2)."""
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
"""The release ``build_llama_cpp.sh`` builds by default."""

# Runs the converter as its own script would run, first declaring the pre-tokenizer when asked to.
_BOOTSTRAP = """
import runpy, sys
from pathlib import Path
script, pre = sys.argv[1], sys.argv[2]
sys.argv = [script, *sys.argv[3:]]
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]
if pre:
    from conversion import base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(script, run_name="__main__")
"""


def available() -> str | None:
    """None when the llama.cpp rows can run, else why not."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (benchmarks/build_llama_cpp.sh builds it once into a wheel)"
    if converter() is None:
        return "llama.cpp's convert_hf_to_gguf.py not found (set LLAMA_CPP_CONVERT or LLAMA_CPP_DIR)"
    return None


def llama_cpp_dirs() -> list[Path]:
    """Where llama.cpp's converter and ``bin/llama-server`` may be: ``LLAMA_CPP_DIR``, then the folder
    ``build_llama_cpp.sh`` keeps beside its wheels, named for the installed llama-cpp-python (or, without it,
    the script's default release)."""
    dirs = [Path(os.environ["LLAMA_CPP_DIR"])] if os.environ.get("LLAMA_CPP_DIR") else []
    try:
        release = version("llama-cpp-python")
    except PackageNotFoundError:
        release = LLAMA_CPP_PYTHON_VERSION
    wheels = Path(os.environ.get("MLXCHAT_WHEELS", Path.home() / ".cache" / "mlxchat" / "wheels"))
    return [*dirs, wheels / f"llama.cpp-{release}"]


def converter() -> Path | None:
    candidates = [os.environ.get("LLAMA_CPP_CONVERT"), *(str(d / "convert_hf_to_gguf.py") for d in llama_cpp_dirs())]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def converted(folder: Path, kind: str) -> Path:
    """Where the GGUF of a checkpoint folder lives (made by :func:`convert`)."""
    path = GGUF_DIR / f"{folder.name}-{kind}.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path}: not converted yet (python -m benchmarks.gguf {folder} {kind})")
    return path


def _pre_tokenizer(folder: Path) -> str:
    """"gpt-2" for the benchmark's synthetic vocabulary and the demo model's (see the module docstring), else
    "" (detected)."""
    marker = folder / MARKER
    synthetic = marker.exists() and json.loads(marker.read_text())["tokenizer"].startswith("synthetic")
    return "gpt-2" if synthetic or folder.resolve() == DEMO.resolve() else ""


def _mtp_flags(folder: Path) -> list[str]:
    """``--no-mtp`` where the config declares multi-token-prediction layers (see the module docstring)."""
    config = json.loads((folder / "config.json").read_text())
    layers = config.get("text_config", config).get("mtp_num_hidden_layers") or config.get("mtp_num_hidden_layers")
    return ["--no-mtp"] if layers else []


def _fresh(target: Path, folder: Path) -> bool:
    return target.exists() and target.stat().st_mtime >= (folder / "config.json").stat().st_mtime


def convert(folder: Path, kind: str) -> Path:
    if kind not in TYPES:
        raise ValueError(f"GGUF type must be one of {', '.join(TYPES)}, got {kind!r}")
    script = converter()
    if script is None:
        raise RuntimeError(available())
    GGUF_DIR.mkdir(parents=True, exist_ok=True)
    target = GGUF_DIR / f"{folder.name}-{kind}.gguf"
    if _fresh(target, folder):
        return target
    partial = target.with_suffix(".partial")
    if kind in CONVERTED:
        command = [sys.executable, "-c", _BOOTSTRAP, str(script), _pre_tokenizer(folder), str(folder),
                   "--outfile", str(partial), "--outtype", kind, *_mtp_flags(folder)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    else:
        quantize(convert(folder, "f32"), partial, kind)
    partial.rename(target)
    return target


def quantize(source: Path, target: Path, kind: str) -> None:
    """llama.cpp's own quantizer, from F32 to ``kind``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPES[kind]
    params.nthread = os.cpu_count() or 1
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {kind} failed ({code})")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(convert(Path(sys.argv[1]), sys.argv[2]))
