"""Errors the gateway answers itself, in the OpenAI error shape."""

from __future__ import annotations

import json


class RequestError(Exception):
    """A request the gateway refuses; carries the HTTP status and the OpenAI error body.

    Raised by request parsing (400/404/413) and, for shedding, by a scheduler (429); the
    server turns it into an Envoy local reply.
    """

    def __init__(
        self, status: int, message: str, error_type: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        # `code` carries the HTTP status, as vLLM's own error responses do.
        error = {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.status,
        }
        return json.dumps({"error": error}).encode()

    @classmethod
    def bad_request(cls, message: str, param: str | None = None) -> RequestError:
        return cls(400, message, "invalid_request_error", param)

    @classmethod
    def not_found(cls, message: str) -> RequestError:
        return cls(404, message, "not_found_error")

    @classmethod
    def too_large(cls, limit: int) -> RequestError:
        return cls(413, f"request body exceeds the limit of {limit} bytes", "invalid_request_error")

    @classmethod
    def no_endpoint(
        cls, message: str = "no endpoint available to serve the request"
    ) -> RequestError:
        return cls(503, message, "service_unavailable")

    @classmethod
    def shed(cls, message: str = "the pool is saturated; request shed") -> RequestError:
        return cls(429, message, "rate_limit_exceeded")

    @classmethod
    def internal(cls, request_id: str) -> RequestError:
        return cls(
            500, f"internal error in the endpoint picker (request {request_id})", "internal_error"
        )
