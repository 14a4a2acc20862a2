"""A llama-architecture GGUF with random weights, of the shape named, for scripts/gpu-check.

`1b` has Llama 3.2 1B's shape (16 layers, width 2048, 32 query and 8 KV heads of 64, a
feed-forward of 8192, a vocabulary of 128,256, tied embeddings: 1.24 billion parameters, F16,
2.5 GB): a GPU's memory traffic and kernels are those of a real 1B model. `tiny` is a small
one for the CPU dry run. The vocabulary is a SentencePiece-style one made up here (control
tokens, the 256 byte tokens, then filler pieces), so the file needs nothing from outside.

    python scripts/gpu_model.py 1b /tmp/model.gguf
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np

SHAPES: dict[str, dict[str, int]] = {
    "1b": {"n_layer": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "n_ff": 8192, "n_vocab": 128256},
    "tiny": {"n_layer": 2, "n_embd": 128, "n_head": 4, "n_head_kv": 2, "n_ff": 256, "n_vocab": 1024},
}
_STD = 0.02


def write(path: Path, name: str, seed: int = 0) -> Path:
    """Write the model of shape `name` to `path` (deterministic for a seed)."""
    shape = SHAPES[name]
    n_layer, n_embd, n_head = shape["n_layer"], shape["n_embd"], shape["n_head"]
    n_head_kv, n_ff, n_vocab = shape["n_head_kv"], shape["n_ff"], shape["n_vocab"]
    head = n_embd // n_head
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"kvkeep random {name}")
    w.add_context_length(131072)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_vocab_size(n_vocab)
    _vocabulary(w, n_vocab)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * _STD).astype(np.float16)

    ones = np.ones(n_embd, dtype=np.float32)
    w.add_tensor("token_embd.weight", matrix(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", ones)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(n_head_kv * head, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(n_head_kv * head, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocabulary(w: gguf.GGUFWriter, n_vocab: int) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    kinds += [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    kinds += [gguf.TokenType.NORMAL] * (n_vocab - len(kinds))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(n_vocab)])
    w.add_token_types(kinds)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)


if __name__ == "__main__":
    write(Path(sys.argv[2]), sys.argv[1])
