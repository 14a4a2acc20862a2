"""Settings: declared once, read from flags, the environment and a TOML file.

May import: the cross-cutting leaves (errors, request limits, files), urls and the model
file's choice (kvkeepd.model) only.
"""
