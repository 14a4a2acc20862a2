"""The OpenAI-compatible HTTP door (on by default beside gRPC: `kvkeep serve --http-port N`, `--http off`).

<!-- generated: modules -->
- app.py: The OpenAI-compatible HTTP door: /v1/chat/completions, /v1/completions, /v1/models and
  /v1/responses (responses.py).
- bodies.py: Response bodies of the OpenAI-compatible door: completions, their stream chunks,
  usage, logprobs and errors, as OpenAI's API shapes them.
- body_limits.py: Request bodies refused by their size (413) before they are read whole or
  parsed: each path's limit is what its largest valid request can need, within
  `--max-message-bytes`.
- browsers.py: What keeps a web page from driving the HTTP door.
- door.py: uvicorn serving the door's application as a task of the daemon's own event loop, so
  its handlers reach the SessionManager directly.
- guard.py: What keeps idle and slow connections from closing the HTTP door.
- keep.py: The sessions the HTTP door keeps between requests that name no session.
- response_schema.py: The request body of OpenAI's Responses API (`POST /v1/responses`), as a
  typed model, and what it means for the session layer: the messages its input items add, a
  Turn, and whether it is stored.
- response_shapes.py: The bodies of OpenAI's Responses API: the response object, its output
  items and usage, the input items listing, and the server-sent events of a streamed response
  (each with its `sequence_number`), live or replayed from a stored response.
- responses.py: OpenAI's Responses API on the HTTP door: `POST /v1/responses`, `GET` and `DELETE
  /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`; and `GET /v1/responses`, the
  caller's stored responses listed (a route OpenAI does not have), so that one whose ids were
  lost can be deleted.
- schema.py: Request bodies of the OpenAI-compatible door, as typed models, and what they mean
  for the session layer (messages, tools, a Turn).
- waiting.py: A handler's work as the door waits for it: watching its client (one that leaves
  stops the work), and noting what it cost in the request's access line.
- anthropic/: Anthropic's Messages API on the HTTP door (`/v1/messages`), beside the OpenAI
  routes.
<!-- end -->
"""
