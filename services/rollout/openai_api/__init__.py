"""An OpenAI-compatible HTTP API on every rollout replica, with token-in/token-out sessions.

`replica.py` assembles it for a replica; `app.py` has the routes, `generation.py` turns a
request into sampled choices, `render.py` applies the chat template, `tool_calls.py`
parses calls, `sessions.py` records episodes and exports trajectories, `responses.py`
writes OpenAI bodies, `errors.py` the error bodies, `guards.py` authentication and size
bounds, `bridge.py` crosses from the HTTP thread to the engine's loop. See
docs/openai_api.md.
"""
