"""Connecting to a secured NATS server: credentials, TLS, and the nats-py options they become.

:class:`ConnectionSecurity` holds how the client proves who it is and how it
checks the server; :class:`~eventstore.EventStoreSettings` inherits its fields
(``JETSOURCING_USER``, ``JETSOURCING_TLS_CA_FILE``, ...) and the Spark
``jetstream`` data source takes them as options of the same names.
:func:`connect_options` is the one place that turns them into keyword
arguments of nats-py's ``connect()``.

One way to authenticate at a time: nats-py would silently use one and ignore
the others (nkey or ``.creds`` first, then user/password, then token, then
credentials in the URL), and a server rejecting the one it picked would be a
puzzle. Secrets are :class:`~pydantic.SecretStr` and errors never repeat the
input, so neither reprs nor validation errors show them; files are checked
when the settings are made, so a wrong path fails at once, naming the setting.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = [
    "ConnectionSecurity", "ReplaySecurity", "check_url_credentials", "connect_options", "redact_url", "tls_context",
]

_FILES = ("nkey_seed_file", "credentials_file", "tls_ca_file", "tls_cert_file", "tls_key_file")


class ConnectionSecurity(BaseModel):
    """How the client authenticates to the server and secures the connection (immutable, validated).

    Every field is optional: none set is an unsecured connection. Set at most
    one of user+password, ``token``, ``nkey_seed_file`` and ``credentials_file``;
    TLS (``tls_*``) combines with any of them. Paths must exist where the client
    runs (for Spark: on the driver and on every executor).
    """

    # hide_input_in_errors: a validation error must not print the password or token it was given.
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    user: str | None = Field(
        default=None,
        min_length=1,
        description="User name for a server with user/password authorization; needs password. "
        "The URL form nats://user:password@host:4222 works too.",
    )
    password: SecretStr | None = Field(default=None, description="Password of user (never shown in reprs or errors).")
    token: SecretStr | None = Field(
        default=None, description="Token for a server with token authorization. The URL form nats://token@host:4222 works too."
    )
    nkey_seed_file: Path | None = Field(
        default=None,
        description="File holding a user nkey seed (SU...), for a server that authorizes nkeys. The seed stays "
        "here: the client signs the server's challenge with it.",
    )
    credentials_file: Path | None = Field(
        default=None,
        description="A .creds file (user JWT and nkey seed, as `nsc` writes it), for a server in operator (JWT) mode.",
    )
    tls_ca_file: Path | None = Field(
        default=None,
        description="PEM file of the CA(s) to trust for the server's certificate. None: the system trust store.",
    )
    tls_cert_file: Path | None = Field(
        default=None, description="PEM client certificate, for a server that requires mutual TLS; needs tls_key_file."
    )
    tls_key_file: Path | None = Field(default=None, description="PEM private key (unencrypted) of tls_cert_file.")
    tls_hostname: str | None = Field(
        default=None,
        min_length=1,
        description="Name the server's certificate must carry, when it is not the URL's host (e.g. a URL with an IP).",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        problems = _pairing_problems(self) + _file_problems(self)
        if problems:
            raise ValueError(" ".join(problems))
        return self

    def authentication(self) -> list[str]:
        """The ways to authenticate that are set, by setting name (at most one once validated)."""
        methods = ["user/password"] if self.user is not None or self.password is not None else []
        return methods + [name for name in ("token", "nkey_seed_file", "credentials_file") if getattr(self, name)]

    def files(self) -> dict[str, Path]:
        """The file settings that are set, by setting name: what must exist wherever a client connects."""
        return {name: path for name in _FILES if (path := getattr(self, name)) is not None}

    def as_options(self) -> dict[str, str]:
        """The fields that are set, as strings, secrets included: the ``jetstream`` data source's options."""
        values = self.model_dump(include=set(ConnectionSecurity.model_fields), exclude_none=True)
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else str(v) for k, v in values.items()}


class ReplaySecurity(ConnectionSecurity):
    """:class:`ConnectionSecurity` plus the nats-py connect options that the replays' bulk-read connection honours
    too (see :mod:`eventstore.nats_options`): a TLS context of the caller's, TLS before the server's INFO, and the
    prefix of its reply subjects."""

    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True, arbitrary_types_allowed=True)

    tls: ssl.SSLContext | None = Field(default=None, repr=False, description="nats-py's tls=: used as given.")
    tls_handshake_first: bool = Field(default=False, description="nats-py's tls_handshake_first=: TLS before INFO.")
    inbox_prefix: str = Field(
        default="_INBOX", pattern=r"^[^\s*>]+$", description="nats-py's inbox_prefix=: the replies' subject prefix."
    )


def _pairing_problems(security: ConnectionSecurity) -> list[str]:
    problems = []
    if (security.user is None) != (security.password is None):
        have, missing = ("user", "password") if security.password is None else ("password", "user")
        problems.append(
            f"{have} is set but {missing} is not: set both (JETSOURCING_USER and JETSOURCING_PASSWORD), or neither."
        )
    methods = security.authentication()
    if len(methods) > 1:
        problems.append(
            f"Set one way to authenticate, not several: {' and '.join(methods)} are set. "
            "Keep the one the server expects."
        )
    if (security.tls_cert_file is None) != (security.tls_key_file is None):
        have, missing = ("tls_cert_file", "tls_key_file")
        if security.tls_cert_file is None:
            have, missing = missing, have
        problems.append(
            f"{have} is set but {missing} is not: a client certificate needs its private key. Set both, or neither."
        )
    return problems


def _missing_files(security: ConnectionSecurity) -> list[str]:
    return [
        f"{name} is {path}, but there is no file there (JETSOURCING_{name.upper()}): fix the path, or unset it."
        for name, path in security.files().items()
        if not path.is_file()
    ]


def _file_problems(security: ConnectionSecurity) -> list[str]:
    missing = _missing_files(security)
    if missing:
        return missing
    # The files exist: check they hold what nats-py and ssl expect, so a wrong file fails here,
    # naming the setting, rather than as a handshake error. (nats-py reads a .creds file without
    # a JWT in an endless loop.)
    problems = []
    if security.nkey_seed_file is not None:
        import nkeys  # here: it loads libsodium, which only nkey users need

        try:
            nkeys.from_seed(bytearray(security.nkey_seed_file.read_bytes().strip())).wipe()
        except Exception:  # noqa: BLE001 - nkeys raises its own errors and binascii/ValueError alike
            problems.append(
                f"nkey_seed_file {security.nkey_seed_file} does not hold an nkey seed: it must hold one line "
                "starting with 'SU', as `nk -gen user` writes it."
            )
    if security.credentials_file is not None:
        text = security.credentials_file.read_bytes()
        if b"BEGIN NATS USER JWT" not in text or b"BEGIN USER NKEY SEED" not in text:
            problems.append(
                f"credentials_file {security.credentials_file} is not a .creds file: it must hold a "
                "'BEGIN NATS USER JWT' and a 'BEGIN USER NKEY SEED' block, as `nsc generate creds` writes them."
            )
    if not problems:
        try:
            tls_context(security)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def tls_context(security: ConnectionSecurity) -> ssl.SSLContext | None:
    """The TLS context the settings ask for, or None when they name no TLS file.

    The context verifies the server's certificate against ``tls_ca_file`` (or the
    system trust store) and presents ``tls_cert_file`` when the server asks for a
    client certificate. With None, nats-py still speaks TLS to a server that
    requires it, or to a ``tls://`` URL, trusting the system store. Raises
    :class:`ValueError`, naming the setting, when a file cannot be loaded.
    """
    if isinstance(security, ReplaySecurity) and security.tls is not None:
        return security.tls  # the caller's own context, passed to connect() as tls=
    ca, cert, key = security.tls_ca_file, security.tls_cert_file, security.tls_key_file
    if ca is None and cert is None:
        return None
    try:
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"tls_ca_file {ca} holds no PEM CA certificate that can be loaded ({exc}).") from None
    if cert is not None:
        try:
            # A password callback that gives none: an encrypted key fails here instead of
            # OpenSSL prompting on a terminal that a server or Spark executor does not have.
            context.load_cert_chain(str(cert), str(key), password=lambda: b"")
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"tls_cert_file {cert} and tls_key_file {key} cannot be loaded as a certificate and its unencrypted "
                f"private key, both PEM ({exc})."
            ) from None
    return context


def connect_options(security: ConnectionSecurity) -> dict[str, Any]:
    """nats-py ``connect()`` keyword arguments for ``security`` (an :class:`~eventstore.EventStoreSettings` will do).

    Only what is set is returned, so credentials in the URL keep working when
    no credential setting is given. The TLS context is built anew on every call.
    Raises :class:`ValueError`, naming the setting, when a file is missing here:
    the settings were checked where they were made, which for a Spark executor
    is another machine.
    """
    missing = _missing_files(security)
    if missing:
        raise ValueError(" ".join(missing))
    options: dict[str, Any] = {}
    if security.user is not None and security.password is not None:
        options["user"] = security.user
        options["password"] = security.password.get_secret_value()
    if security.token is not None:
        options["token"] = security.token.get_secret_value()
    if security.nkey_seed_file is not None:
        options["nkeys_seed"] = str(security.nkey_seed_file)
    if security.credentials_file is not None:
        options["user_credentials"] = str(security.credentials_file)
    context = tls_context(security)
    if context is not None:
        options["tls"] = context
    if security.tls_hostname is not None:
        options["tls_hostname"] = security.tls_hostname
    return options


def check_url_credentials(url: str | None, security: ConnectionSecurity) -> None:
    """Raise :class:`ValueError` if ``url`` carries credentials and ``security`` names a way to authenticate too."""
    methods = security.authentication()
    if url and methods and any(_split_userinfo(u)[1] for u in url.split(",")):
        raise ValueError(
            f"The server URL carries credentials (user:password@ or token@) and {methods[0]} is set too: "
            "give them one way only."
        )


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _split_userinfo(url: str) -> tuple[str, str, str]:
    """``url`` as (scheme with its ``://`` or "", the userinfo before the last ``@`` or "", the rest).

    nats-py takes a URL with or without a scheme (``user:secret@host:4222``
    is ``nats://user:secret@host:4222``); everything before the last ``@`` is
    taken as credentials, even what a URL parser would read as a path (a
    password holding ``/``, ``?`` or ``#``), so that no part of one is shown.
    """
    url = url.strip()
    scheme = found.group(0) if (found := _SCHEME.match(url)) else ""
    userinfo, _, rest = url[len(scheme) :].rpartition("@")
    return scheme, userinfo, rest


def redact_url(url: str) -> str:
    """``url`` (one or comma-separated, each with or without a scheme, as nats-py takes them) with any password
    or token in it replaced by ``***``, for messages and logs: ``user:secret@host:4222`` is shown as
    ``user:***@host:4222``, ``nats://token@host`` as ``nats://***@host``."""
    redacted = []
    for part in url.split(","):
        scheme, userinfo, rest = _split_userinfo(part)
        if userinfo:
            user, colon, _ = userinfo.partition(":")
            redacted.append(f"{scheme}{user + ':***' if colon else '***'}@{rest}")
        else:
            redacted.append(part.strip())
    return ",".join(redacted)
