"""The values every layer trades in: messages, sampling parameters, structured-output specs,
generation requests and their chunks, and tool calls.

A leaf: it imports only the errors, the request limits and numpy, so that the byte formats (a
manifest) and the doors can name these values without pulling in jinja2, llguidance or
llama.cpp. Each is a frozen dataclass (a message a session records is the exception: its list
is the session's own) or a `Literal`, whose allowed strings are its tuple.

<!-- generated: modules -->
- constraints.py: Structured output's values: what a request asked its output to match, and a
  session's open constraint.
- generation.py: Generations: what a request says besides its prompt, a validated request, and
  what it streams back (chunks, usage, logprobs, progress, finish reasons).
- messages.py: Messages of a conversation: roles, a message and a session's recorded one, their
  checks, and what a chat turn that does not fit does (context policies).
- sampling.py: Sampling parameters: a session's, and the fields a request overrides.
- toolcall.py: Tool calls' values: the tools a model may call, which of them a turn must call,
  the calls a reply makes and the pieces they stream in.
<!-- end -->
"""
