"""One HTTP client for the control plane: health, /metrics, /props, one-off posts.

`httpx.get` builds a client per call, and its TLS context alone costs ~30 ms (llama-server's /metrics
on the 2-core rehearsal box: 30.6 ms a call, 0.86 ms on a kept client): scraped between acceptance
requests, 4 s of a 10 s probe. The client is thread-safe, shared by the process, and kept alive.
"""

from __future__ import annotations

from functools import cache

import httpx

from tasks.client import auth


@cache
def control() -> httpx.Client:
    # Every request carries the API key its server demands, if it demands one (tasks/client/auth.py).
    return httpx.Client(limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
                        event_hooks={"request": [auth.sign]})
