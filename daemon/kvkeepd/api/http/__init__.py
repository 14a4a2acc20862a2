"""The HTTP door (on by default beside gRPC: `kvkeep serve --http-port N`, `--http off`): a
folder per API (`chat/`, `responses/`, `anthropic/`), and at the root what serves them all.

<!-- generated: modules -->
- app.py: The HTTP door's application: each API's routes (chat/, responses/, anthropic/,
  console/) and what they share, /v1/models, /health and /ready.
- body.py: Request bodies' common ground: reading one within the door's limit, the base of their
  typed models and their parsing, the roles of OpenAI's messages, and the cache salt a request
  may give.
- body_limits.py: Request bodies refused by their size (413) before they are read whole or
  parsed: each path's limit is what its largest valid request can need, within
  `--max-message-bytes`.
- browsers.py: What keeps a web page from driving the HTTP door.
- door.py: uvicorn serving the door's application as a task of the daemon's own event loop, so
  its handlers reach the SessionManager directly.
- guard.py: What keeps idle and slow connections from closing the HTTP door.
- handlers.py: What the door's application (app.py) gives an API's handlers: the manager, the
  served model's name, the sessions kept between requests, how a caller is resolved and a body
  read, and how often a quiet stream sends a heartbeat.
- keep.py: The sessions the HTTP door keeps between requests that name no session.
- logprobs.py: Generated tokens' log probabilities as OpenAI's chat completions and Responses
  API write them.
- openai.py: What OpenAI's APIs on the HTTP door write alike: the error envelope and each
  error's status, and the engine's finish reasons as OpenAI names them.
- sse.py: Server-sent events, as every API of the HTTP door streams them, and the heartbeats
  that keep a stream alive while it has nothing to say.
- waiting.py: A handler's work as the door waits for it: watching its client (one that leaves
  stops the work), and noting what it cost in the request's access line.
- anthropic/: Anthropic's Messages API on the HTTP door (`/v1/messages`), beside the OpenAI
  routes.
- chat/: OpenAI's chat completions and completions on the HTTP door (`/v1/chat/completions`,
  `/v1/completions`): their request bodies, their replies and their handlers.
- console/: The web console on the HTTP door (`GET /`, `--console on|read-only|off`): a tenant's
  sessions, each one's tree of checkpoints and forks, its stored responses, a chat pane and the
  daemon at a glance, in a browser.
- responses/: OpenAI's Responses API on the HTTP door (`/v1/responses`): its request body, its
  response objects and events, and its routes.
<!-- end -->
"""
