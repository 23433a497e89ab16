"""The ``jetstream`` data source's options, checked once where they are given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from eventstore import ConnectionSecurity
from eventstore.nats_options import check_tcp_urls
from eventstore.security import check_url_credentials, redact_url
from eventstore.streams import filter_subjects, validate_category
from spark_projections.errors import EventSourceError

DEFAULT_BATCH = 5000
"""Messages per pull request (the ``batch`` option)."""


@dataclass(frozen=True)
class Options:
    url: str  # for messages: a password or token in it is shown as ***
    servers: tuple[str, ...]
    stream: str
    subject_prefix: str
    categories: tuple[str, ...]
    from_position: int
    to_position: int | None
    partitions: int
    batch: int
    request_timeout_s: float
    security: ConnectionSecurity

    @classmethod
    def parse(cls, options: Any) -> Options:
        """Validate the reader options (Spark hands them over as a case-insensitive str map)."""
        opts = {str(k).lower(): str(v) for k, v in dict(options).items()}
        url = opts.get("url", "").strip()
        if not url:
            raise EventSourceError(
                "The jetstream data source needs the server URL: .option('url', 'nats://host:4222') "
                "(comma-separate several servers of a cluster)."
            )
        categories = tuple(c.strip() for c in opts.get("categories", "").split(",") if c.strip())
        try:
            for category in categories:
                validate_category(category)
        except Exception as exc:
            raise EventSourceError(f"Option 'categories': {exc}") from None
        from_position = int_option(opts, "from_position", 1, minimum=1) or 1
        to_position = int_option(opts, "to_position", None, minimum=0)
        given = {name: value for name, value in opts.items() if name in ConnectionSecurity.model_fields}
        try:
            security = ConnectionSecurity.model_validate(given)
            check_url_credentials(url, security)
            check_tcp_urls(url)  # the reader speaks NATS over TCP: a ws:// URL would fail on every executor
        except ValidationError as exc:
            raise EventSourceError(f"Connection options: {_problems(exc)}") from None
        except ValueError as exc:
            raise EventSourceError(f"Connection options: {exc}") from None
        return cls(
            url=redact_url(url),
            servers=tuple(u.strip() for u in url.split(",")),
            stream=opts.get("stream", "EVENTS"),
            subject_prefix=opts.get("subject_prefix", "events"),
            categories=categories,
            from_position=from_position,
            to_position=to_position,
            partitions=int_option(opts, "partitions", 1, minimum=1) or 1,
            batch=int_option(opts, "batch", DEFAULT_BATCH, minimum=1) or DEFAULT_BATCH,
            request_timeout_s=float(opts.get("request_timeout_s", "5")),
            security=security,
        )

    @property
    def filter_subjects(self) -> list[str]:
        return filter_subjects(self.subject_prefix, self.categories)


def _problems(exc: ValidationError) -> str:
    """What a validation error says, without pydantic's boilerplate."""
    return " ".join(
        str(error["ctx"]["error"]) if "error" in error.get("ctx", {}) else f"{error['loc'][0]}: {error['msg']}."
        for error in exc.errors()
    )


def int_option(opts: dict[str, str], name: str, default: int | None, *, minimum: int) -> int | None:
    text = opts.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise EventSourceError(f"Option {name!r} must be an integer, not {text!r}.") from None
    if value < minimum:
        raise EventSourceError(f"Option {name!r} must be at least {minimum}, not {value}.")
    return value
