"""llama.cpp and the one thread that owns it: the model and context, the start-up
probes, the engine's steps, jobs, sampling and grammars.

`context.py` is the only importer of llama_cpp. May import: the leaves and `state`.
"""
