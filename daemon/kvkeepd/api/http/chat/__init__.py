"""OpenAI's chat completions and completions on the HTTP door (`/v1/chat/completions`,
`/v1/completions`): their request bodies, their replies and their handlers.

<!-- generated: modules -->
- door.py: OpenAI's chat completions and completions on the HTTP door: `POST
  /v1/chat/completions` and `POST /v1/completions`.
- schema.py: Request bodies of OpenAI's chat completions and completions, as typed models, and
  what they mean for the session layer (messages, tools, a Turn).
- shapes.py: Response bodies of OpenAI's chat completions and completions: completions, their
  stream chunks, usage and logprobs, as OpenAI's API shapes them.
<!-- end -->
"""
