"""The servers a bulk-read connection may open: the configured ones and those the cluster advertises.

As nats-py's server pool does (``Client._setup_server_pool`` and
``_process_info``): the configured servers are tried in random order, so many
clients do not all land on the first; then the servers the cluster advertised
in its INFO (``connect_urls``), also shuffled. A seed that is down (or silent)
so no longer hides the rest of a cluster. Advertised servers take the scheme
and the URL credentials of the server that advertised them, and, for TLS, its
host name when they are advertised by IP address (the certificate names the
host, not the address).
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Candidate", "ServerPool"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """One server to try: its URL, and the host name its TLS certificate must show (None: the URL's host)."""

    url: str
    tls_name: str | None = None


def _netloc(url: str) -> str:
    """``host:port`` of ``url`` (credentials left out; 4222 by default), to tell servers apart."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname}:{parts.port or 4222}"


def _is_ip(host: str | None) -> bool:
    try:
        ipaddress.ip_address(host or "")
    except ValueError:
        return False
    return True


class ServerPool:
    """The configured servers plus the ones learnt from INFO; :meth:`candidates` is the order to try them in."""

    def __init__(self) -> None:
        self._advertised: dict[str, Candidate] = {}  # by host:port

    def learn(self, info: dict[str, object], origin: str) -> None:
        """Add the servers ``info`` (a server's INFO) advertises, reached as ``origin`` (the URL connected to)."""
        urls = info.get("connect_urls")
        if not isinstance(urls, list):
            return
        parts = urlsplit(origin if "://" in origin else f"nats://{origin}")
        scheme = "tls" if parts.scheme == "tls" else "nats"
        userinfo = parts.netloc.rpartition("@")[0]
        for address in urls:
            if not isinstance(address, str) or not address:
                continue
            url = f"{scheme}://{userinfo + '@' if userinfo else ''}{address}"
            host = urlsplit(url).hostname
            tls_name = parts.hostname if _is_ip(host) and not _is_ip(parts.hostname) else None
            self._advertised.setdefault(_netloc(url), Candidate(url, tls_name))

    def candidates(self, configured: list[str]) -> list[Candidate]:
        """The configured servers shuffled, then the advertised ones not among them, shuffled."""
        first = [Candidate(url) for url in configured]
        random.shuffle(first)
        known = {_netloc(url) for url in configured}
        then = [c for where, c in self._advertised.items() if where not in known]
        random.shuffle(then)
        return first + then
