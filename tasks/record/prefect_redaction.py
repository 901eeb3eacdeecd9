"""Nothing this process hands to Prefect carries a known secret value.

At Prefect's edges, not at each call site: Prefect writes text lanebench never sees (a failure
message is `format_exception` of whatever was raised, e.g. a server error echoing its `--api-key`;
parameters are whatever a flow got). Three edges carry all of it: the log handlers (`SecretFilter`
on every `prefect*` and root handler, the API log handler included), the API's HTTP clients
(request bodies scrubbed before sending) and the events client (Prefect 3 reports task-run
states as events). Values are those tasks/inventory/secrets.py knows, raw and JSON-escaped.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from tasks.inventory.secrets import REDACTED, known_values, scrub

_INSTALLED = False


class SecretFilter(logging.Filter):
    """Scrubs a record in place (message, arguments, traceback, stack); never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not known_values():
            return True
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the handler's to report
            return True
        record.msg, record.args = scrub(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


_FILTER = SecretFilter()


def scrub_json_bytes(body: bytes) -> bytes:
    """A JSON (or any UTF-8) body with every known value replaced, raw or JSON-escaped."""
    for value in known_values():
        for form in {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1]}:
            body = body.replace(form.encode(), REDACTED.encode())
    return body


def filter_log_handlers() -> None:
    """`SecretFilter` on every handler of the root and `prefect*` loggers (idempotent; call after
    Prefect configured its logging: `import prefect.main`)."""
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
                                       if name == "prefect" or name.startswith("prefect.")]
    for logger in loggers:
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)


def _scrubbed_request(request: Any) -> Any:
    import httpx

    body = request.content if request.method in ("POST", "PUT", "PATCH") else b""
    if not body or not known_values():
        return request
    clean = scrub_json_bytes(body)
    if clean == body:
        return request
    headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
    return httpx.Request(request.method, request.url, headers=headers, content=clean,
                         extensions=request.extensions)


def install() -> None:
    """Scrub at all three edges, once per process."""
    global _INSTALLED
    import prefect.main  # noqa: F401  # configures Prefect's logging: its handlers exist from here on

    filter_log_handlers()
    if _INSTALLED:
        return
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient
    from prefect.events.clients import EventsClient
    from prefect.events.schemas.events import Event

    send_async, send_sync, emit = PrefectHttpxAsyncClient.send, PrefectHttpxSyncClient.send, EventsClient.emit

    async def scrubbed_send_async(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        return await send_async(self, _scrubbed_request(request), *args, **kwargs)

    def scrubbed_send_sync(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        return send_sync(self, _scrubbed_request(request), *args, **kwargs)

    async def scrubbed_emit(self: Any, event: Any) -> None:
        if known_values():
            raw = event.model_dump_json().encode()
            if (clean := scrub_json_bytes(raw)) != raw:
                event = Event.model_validate_json(clean)
        return await emit(self, event)

    PrefectHttpxAsyncClient.send = scrubbed_send_async  # type: ignore[method-assign]
    PrefectHttpxSyncClient.send = scrubbed_send_sync  # type: ignore[method-assign]
    EventsClient.emit = scrubbed_emit  # type: ignore[method-assign]
    _INSTALLED = True
