"""OpenAI's Responses API on the HTTP door (`/v1/responses`): its request body, its response
objects and events, and its routes.

<!-- generated: modules -->
- door.py: OpenAI's Responses API on the HTTP door: `POST /v1/responses`, `GET` and `DELETE
  /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`; and `GET /v1/responses`, the
  caller's stored responses listed (a route OpenAI does not have), so that one whose ids were
  lost can be deleted.
- schema.py: The request body of OpenAI's Responses API (`POST /v1/responses`), as a typed
  model, and what it means for the session layer: the messages its input items add, a Turn, and
  whether it is stored.
- shapes.py: The bodies of OpenAI's Responses API: the response object, its output items and
  usage, the input items listing, and the server-sent events of a streamed response (each with
  its `sequence_number`), live or replayed from a stored response.
<!-- end -->
"""
