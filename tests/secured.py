"""Material for secured test servers: a CA with server and client certificates, an nkey user, and an operator.

Everything is made fresh in a directory of the test's own: certificates with
``trustme``, keys with ``nkeys``, and the operator's JWTs by hand (the format is
small: three base64url parts, signed with the issuer's nkey), so the servers the
tests start check real signatures.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import trustme

HOSTNAME = "localhost"
"""The only name in the server certificate (no IP address): a URL with 127.0.0.1 needs tls_hostname."""


@dataclass(frozen=True)
class Pki:
    """PEM files: the CA the tests trust, a CA they do not, the server's and a client's certificate and key."""

    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def tls_block(self, *, verify_clients: bool) -> str:
        """A nats-server ``tls { }`` block; ``verify_clients`` requires a client certificate signed by the CA."""
        lines = [f'  cert_file: "{self.server_cert}"', f'  key_file: "{self.server_key}"']
        if verify_clients:
            lines += [f'  ca_file: "{self.ca}"', "  verify: true"]
        return "tls {\n" + "\n".join(lines) + "\n}\n"


def make_pki(directory: Path) -> Pki:
    """Write a fresh :class:`Pki` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, other = trustme.CA(), trustme.CA()
    server, client = ca.issue_cert(HOSTNAME), ca.issue_cert("client@jetsourcing.test")
    pki = Pki(*(directory / name for name in ("ca.pem", "other-ca.pem", "server.pem", "server.key", "client.pem", "client.key")))
    ca.cert_pem.write_to_path(str(pki.ca))
    other.cert_pem.write_to_path(str(pki.other_ca))
    for cert, cert_path, key_path in ((server, pki.server_cert, pki.server_key), (client, pki.client_cert, pki.client_key)):
        cert.cert_chain_pems[0].write_to_path(str(cert_path))
        cert.private_key_pem.write_to_path(str(key_path))
    return pki


def new_keypair(prefix: int) -> nkeys.KeyPair:
    """A fresh nkey pair (``nkeys.PREFIX_BYTE_USER``, ``..._ACCOUNT``, ``..._OPERATOR``)."""
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def write_user_seed(path: Path) -> str:
    """Write a new user nkey seed to ``path``; return its public key (``U...``) for the server's config."""
    user = new_keypair(nkeys.PREFIX_BYTE_USER)
    path.write_bytes(user.seed + b"\n")
    return str(user.public_key.decode())


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(issuer: nkeys.KeyPair, subject: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public_key.decode(), "name": "jetsourcing-test",
                              "sub": subject, "nats": {**nats, "version": 2}}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    signed = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode()) + "." + _b64(json.dumps(claims).encode())
    return signed + "." + _b64(issuer.sign(signed.encode()))


_UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
              "leaf": -1}


@dataclass(frozen=True)
class Operator:
    """An operator-mode (JWT) setup: the server's config and the signing account, which can issue users."""

    config: str
    account: nkeys.KeyPair

    def write_creds(self, path: Path, *, signer: nkeys.KeyPair | None = None) -> Path:
        """Write a ``.creds`` file for a new user signed by ``signer`` (default: the server's account)."""
        user = new_keypair(nkeys.PREFIX_BYTE_USER)
        token = _jwt(signer or self.account, user.public_key.decode(), {"pub": {}, "sub": {}, "subs": -1, "data": -1,
                                                                        "payload": -1, "type": "user"})
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return path


def make_operator() -> Operator:
    """An operator with a JetStream-enabled account and the system account JetStream needs, preloaded in memory."""
    operator = new_keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account, system = new_keypair(nkeys.PREFIX_BYTE_ACCOUNT), new_keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    accounts = {
        account.public_key.decode(): _jwt(operator, account.public_key.decode(),
                                          {"limits": {**_UNLIMITED, **jetstream}, "type": "account"}),
        system.public_key.decode(): _jwt(operator, system.public_key.decode(), {"limits": _UNLIMITED, "type": "account"}),
    }
    config = (
        f"operator: {_jwt(operator, operator.public_key.decode(), {'type': 'operator'})}\n"
        f"system_account: {system.public_key.decode()}\n"
        "resolver: MEMORY\n"
        "resolver_preload: {\n" + "".join(f"  {key}: {token}\n" for key, token in accounts.items()) + "}\n"
    )
    return Operator(config, account)
