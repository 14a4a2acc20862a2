"""llama.cpp and the one thread that owns it: the model and context, the start-up
probes, the engine's steps, jobs, sampling and grammars.

`context.py` is the only importer of llama_cpp. May import: the leaves and `state`.

<!-- generated: modules -->
- backend.py: Backend: what the loaded llama.cpp build is and which devices it runs on, its C
  log routed to Python logging, pinned host memory for transfers to a GPU, and a start given up.
- context.py: LlamaContext: the llama.cpp model and context, and the only module that imports
  llama_cpp.
- context_config.py: What the llama.cpp context is asked to be: ContextConfig, the daemon's
  settings it needs and the mode they make (exact or compact, with or without flash attention),
  and the ggml switches exact mode sets before any graph runs (kernel_environment).
- engine.py: Engine: the one thread that owns llama.cpp (through a LlamaContext).
- job.py: Generations: a session's computed state, a request to extend it, and the token output.
- probes.py: The start-up exactness probe, and its results kept by everything that picks
  llama.cpp's kernels.
- sampling.py: Token sampling that is identical whether a session runs fresh or resumed.
- startup.py: The engine's start, on its thread: the model loaded and its context made, the
  start-up exactness probe run (probes.py) — on exact mode's batch-invariant flash attention
  first and, where it finds a dependence, on attention without flash — and the memory the first
  restores would otherwise fault in mapped.
- steps.py: Step planning: which tokens of which generations go into the next batch.
- streams.py: Streams: how many KV streams the context has, and what each is for.
- structured_output.py: Structured output: a GBNF grammar or a JSON schema, applied as a mask on
  the logits row.
- text.py: Streaming text: bytes of token pieces to UTF-8 text, and stop-string matching.
<!-- end -->
"""
