"""The sidecar's REST routes, one router per concern (FastAPI's "bigger applications" layout).

``health`` is open (probes carry no credentials); every other router requires the bearer
token when one is set (``server.dependencies.require_token``)."""
