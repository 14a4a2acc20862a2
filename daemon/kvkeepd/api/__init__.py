"""The doors: the gRPC servicer and its conversions, the metrics exposition, and the
OpenAI-compatible HTTP door (`http/`).

May import: everything below it; nothing below imports `api`.
"""
