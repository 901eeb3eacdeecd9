"""One HTTP client for the control plane: health, /metrics, /props, one-off posts.

`httpx.get` builds a client per call, and a client's TLS context alone costs ~30 ms (measured
against llama-server's /metrics on the 2-core rehearsal box: 30.6 ms a call, 0.86 ms on a kept
client). Scraped between every acceptance request, that was 4 s of a 10 s probe with nothing in
flight. The client is shared by every thread of the process (httpx.Client is thread-safe) and
keeps its connections alive where the server lets it.
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


__all__ = ["control"]
