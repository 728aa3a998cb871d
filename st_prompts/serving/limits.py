"""What one request and the whole server may ask for, and the errors a request gets (standard library only).

Every refusal is a :class:`RequestError`: an HTTP status and one line, rendered in OpenAI's error schema.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from st_prompts.errors import shorten
from st_prompts.numbers import whole

__all__ = ["EmbeddingRequest", "RequestError", "SearchRequest", "ServingLimits", "parse_embedding_request",
           "parse_search_request"]

#: The longest error message a client gets (a message that quotes input is cut here at the latest).
MESSAGE_CHARS = 1000


@dataclass(frozen=True)
class ServingLimits:
    """Bounds of one server (all configurable from ``st-prompts serve``).

    ``max_inputs`` and ``max_input_chars`` bound ``/v1/embeddings``, ``max_queries`` and ``max_k`` ``/search``;
    ``max_queue_rows`` the rows waiting, all requests together (503 with ``Retry-After`` beyond). ``max_batch_tokens``
    (padded tokens), ``max_batch_rows`` and ``pass_overhead_tokens`` shape a forward pass; ``None``: the device's
    (measured at start on an accelerator).
    """

    max_inputs: int = 2048
    max_input_chars: int = 20_000
    max_body_bytes: int = 4 * 1024 * 1024
    max_queue_rows: int = 4096
    max_wait_ms: float = 2.0
    max_batch_tokens: int | None = None
    max_batch_rows: int | None = None
    pass_overhead_tokens: float | None = None
    max_queries: int = 64
    max_k: int = 100

    def __post_init__(self) -> None:
        for name in ("max_inputs", "max_input_chars", "max_body_bytes", "max_queue_rows", "max_batch_tokens",
                     "max_batch_rows", "max_queries", "max_k"):
            value = getattr(self, name)
            if value is None and name in ("max_batch_tokens", "max_batch_rows"):
                continue  # the device's
            if not whole(value, 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_wait_ms, (int, float)) or not math.isfinite(self.max_wait_ms) \
                or self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be a non-negative number, got {self.max_wait_ms!r}")
        overhead = self.pass_overhead_tokens
        if overhead is not None and (isinstance(overhead, bool) or not isinstance(overhead, (int, float))
                                     or not math.isfinite(overhead) or overhead < 0):
            raise ValueError(f"pass_overhead_tokens must be a non-negative number, got {overhead!r}")


class RequestError(Exception):
    """A refused request: HTTP ``status``, one-line ``message``, OpenAI's ``param``/``code``, ``headers``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        if len(message) > MESSAGE_CHARS:
            message = message[:MESSAGE_CHARS] + "..."
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or _default_kind(status)
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _default_kind(status: int) -> str:
    special = {401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}
    return special.get(status, "server_error" if status >= 500 else "invalid_request_error")


@dataclass(frozen=True)
class EmbeddingRequest:
    """A checked ``POST /v1/embeddings`` body."""

    texts: list[str]
    model: str
    encoding_format: str
    dimensions: int | None


@dataclass(frozen=True)
class SearchRequest:
    """A checked ``POST /search`` body."""

    queries: list[str]
    index: str
    k: int


def _type_name(value: Any) -> str:
    for kind, name in ((type(None), "null"), (bool, "a boolean"), ((int, float), "a number"), (list, "an array"),
                       (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _texts(value: Any, param: str, limits: ServingLimits, *, limit: int, what: str) -> list[str]:
    """``value`` (a string or a list of strings) as a list, checked against the limits."""
    if value is None:
        raise RequestError(422, f"'{param}' is required: a string or a list of strings.", param=param,
                           code="missing_field")
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise RequestError(422, f"'{param}' must be a string or a list of strings, not {_type_name(value)}.",
                           param=param)
    if not value:
        raise RequestError(422, f"'{param}' must not be an empty list.", param=param)
    if len(value) > limit:
        raise RequestError(422, f"'{param}' has {len(value):,} {what}; the limit is {limit:,} per request.",
                           param=param, code="too_many_inputs")
    for position, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise RequestError(422, f"{param}[{position}] is an empty string.", param=param)
            if len(item) > limits.max_input_chars:
                raise RequestError(422, f"{param}[{position}] has {len(item):,} characters; the limit is "
                                   f"{limits.max_input_chars:,}.", param=param, code="input_too_long")
            continue
        if param == "input" and (isinstance(item, int) and not isinstance(item, bool) or isinstance(item, list)):
            raise RequestError(422, "'input' holds token ids: this server takes text only (a string or a list of "
                               "strings).", param=param, code="token_input_unsupported")
        raise RequestError(422, f"{param}[{position}] is {_type_name(item)}; every {what[:-1]} must be a string.",
                           param=param)
    return value


def _name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        shown = "missing" if value is None else _type_name(value)
        raise RequestError(422, f"'{param}' must be a name (a non-empty string), got {shown}.", param=param,
                           code="missing_field" if value is None else None)
    return value


def parse_embedding_request(body: Any, limits: ServingLimits) -> EmbeddingRequest:
    """Check an OpenAI embeddings request (``input``, ``model``, ``encoding_format``, ``dimensions``)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"The request body must be a JSON object, not {_type_name(body)}.")
    texts = _texts(body.get("input"), "input", limits, limit=limits.max_inputs, what="inputs")
    model = _name(body.get("model"), "model")
    encoding = "float" if body.get("encoding_format") is None else body["encoding_format"]
    if encoding not in ("float", "base64"):
        raise RequestError(422, f"'encoding_format' must be 'float' or 'base64', got {shorten(encoding)}.",
                           param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and not whole(dimensions, 1):
        raise RequestError(422, f"'dimensions' must be a positive integer, got {shorten(dimensions)}.",
                           param="dimensions")
    return EmbeddingRequest(texts=texts, model=model, encoding_format=encoding, dimensions=dimensions)


def parse_search_request(body: Any, limits: ServingLimits) -> SearchRequest:
    """Check a search request: ``query`` (a string or a list of strings), ``index`` (a name), ``k`` (default 10)."""
    if not isinstance(body, dict):
        raise RequestError(400, f"The request body must be a JSON object, not {_type_name(body)}.")
    queries = _texts(body.get("query"), "query", limits, limit=limits.max_queries, what="queries")
    index = _name(body.get("index"), "index")
    k = body.get("k", 10)
    if not whole(k, 1, limits.max_k):
        raise RequestError(422, f"'k' must be an integer from 1 to {limits.max_k}, got {shorten(k)}.", param="k")
    return SearchRequest(queries=queries, index=index, k=k)
