"""The OpenAI-compatible HTTP door (on by default beside gRPC: `kvkeep serve --http-port N`, `--http off`).

app.py      the Starlette application: routes, auth, errors
schema.py   request bodies and what they mean for the session layer
bodies.py   response bodies and server-sent events, as OpenAI shapes them
keep.py     the sessions kept between requests that name no session
door.py     uvicorn, run as a task of the daemon's event loop
guard.py    uvicorn's protocol with a read timeout and bounds on connections
"""
