"""The bytes of computed state: llama.cpp's sequence-state layout parsed into cells,
pieces cut on the block grid, block frames and hash chains, checkpoint manifests.

No llama.cpp, no I/O. May import: the leaves only.
"""
