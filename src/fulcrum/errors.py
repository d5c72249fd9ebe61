"""The one error tree: each class knows its HTTP status, so every layer raises and the server maps.

FulcrumError (500)
├── InvalidInput (400)         bad request body, tensor, parameter
├── Forbidden (403)            management API without the admin token
├── NotFound (404)             unknown model, version or route
├── RequestTimeout (408)       request head or body sent too slowly (connection closed)
├── PayloadTooLarge (413)      body over the configured limit
├── HeadersTooLarge (431)      request head over the header size or count limit
├── Unavailable (503)          not ready, queue full (Retry-After), shutting down
│   ├── QueueFull (503)        the queue is at its bound (admission)
│   └── Shed (503)             its deadline can no longer be met; shed before it ran
├── DeadlineExceeded (504)     timed out in the queue; never ran
├── ModelError (500)           the backend raised while running a batch
│   └── ExecutionTimeout (500) the backend ran past its execution limit (hung)
└── ConfigError (500)          malformed config.toml (names the file, key and value)
"""

from __future__ import annotations

import math
import re

_LEADING_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_.\[\]]*): ")


class FulcrumError(Exception):
    """Base of every error Fulcrum raises on purpose."""

    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers the response for this error carries."""
        return {}


class InvalidInput(FulcrumError):
    """The request is malformed: bad JSON, unknown input, wrong datatype or shape. `param` names
    the offending request field (OpenAI's `param`); by the tree's convention a message that opens
    with `field: ` names it, so that is the default."""

    status_code = 400

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        leading = _LEADING_FIELD.match(message)
        self.param = param if param is not None or leading is None else leading.group(1)


class Forbidden(FulcrumError):
    """The route needs the admin token (management API on a non-loopback address)."""

    status_code = 403


class NotFound(FulcrumError):
    """No such model, version or route."""

    status_code = 404


class RequestTimeout(FulcrumError):
    """The client sent its request head or body too slowly; the connection is closed."""

    status_code = 408


class PayloadTooLarge(FulcrumError):
    """The request body exceeds the configured limit."""

    status_code = 413


class HeadersTooLarge(FulcrumError):
    """The request head exceeds the header size or header count limit."""

    status_code = 431


class Unavailable(FulcrumError):
    """The server or model cannot take the request now; the client may retry later."""

    status_code = 503

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        # Whole seconds, rounded up: a client that waits less would only be refused again.
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class QueueFull(Unavailable):
    """The model's queue (for this priority level) is at `max_queue_size`."""

    reason = "queue_full"


class Shed(Unavailable):
    """The adaptive policy predicts the request would miss its deadline even if it ran next;
    `retry_after_s` is the predicted time for the queue to drain (precise; the header rounds up)."""

    reason = "deadline"


class DeadlineExceeded(FulcrumError):
    """The request's timeout passed while it waited in the queue; it never ran."""

    status_code = 504


class ModelError(FulcrumError):
    """The backend raised while executing a batch; only that batch fails."""

    status_code = 500


class ExecutionTimeout(ModelError):
    """The backend ran past the model's execution limit; its instance is marked hung (500)."""


class ConfigError(FulcrumError):
    """A model's configuration is malformed."""

    status_code = 500
