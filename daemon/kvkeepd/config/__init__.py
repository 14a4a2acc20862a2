"""Settings: declared once, read from flags, the environment and a TOML file.

May import: the cross-cutting leaves (errors, limits, files) and urls only.
"""
