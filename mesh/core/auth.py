"""Who is calling, and what they may do: principals, credentials and the rules of the mesh.

A principal is named by a bearer token or by the name in its client certificate. An agent's
principal acts as its own agents only: it registers them, sends as them (``from_agent``) and
receives from their queues. An admin principal (the gateway, an operator) may act as any
agent. Tokens are kept as SHA-256 digests, and a token presented is looked up by its digest;
no credential is ever logged or put in an error message.

The credentials file (JSON)::

    {"principals": [
        {"name": "payment", "token_sha256": "<64 hex digits>", "agents": ["PaymentAgent"]},
        {"name": "hotel", "token": "…", "agents": ["HotelAgent"]},
        {"name": "gateway", "token": "…", "admin": true},
        {"name": "HotelAgent", "agents": ["HotelAgent"]}
    ]}

A principal's token is given as itself (``token``) or as its SHA-256 digest in hex
(``token_sha256``, what ``agentmesh credentials`` writes): a file of digests, on every server
that reads it, holds no token anyone could send. A principal without a token is known by its
certificate only (the certificate's common name,
or a DNS name in it, equals ``name``). With mutual TLS and no entry for a certificate's name,
the name itself is the one agent it may act as.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mesh.core.errors import PermissionDeniedError, UnauthenticatedError

JSONDict = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller."""

    name: str
    agents: frozenset[str] = field(default_factory=frozenset)
    admin: bool = False

    def may_act_as(self, agent_id: str) -> bool:
        return self.admin or agent_id in self.agents

    def require_agent(self, agent_id: str, what: str) -> None:
        """Raises PermissionDeniedError unless this principal may act as ``agent_id``."""
        if not self.may_act_as(agent_id):
            shown = agent_id or "(no agent)"
            raise PermissionDeniedError(f"{self.name} may not {what} as {shown}")


ANONYMOUS = Principal("anonymous", admin=True)
"""The caller when security is off: the embedded localhost default trusts everyone."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticates(Protocol):
    """What authenticates a call: an :class:`Authenticator`, or one that a file renews."""

    def authenticate(
        self, token: str | None, certificate_names: Iterable[str] = ()
    ) -> Principal: ...


class Authenticator:
    """Maps credentials (bearer tokens, certificate names) to principals."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(
        self,
        principals: Iterable[tuple[Principal, str | bytes | None]] = (),
        *,
        certificate_names: bool = False,
    ) -> None:
        """``principals``: each with its token (or that token's SHA-256 digest, as bytes), or
        None when known by certificate only.
        ``certificate_names``: whether a verified client certificate identifies its holder
        (mutual TLS)."""
        # By the token's digest: a lookup costs the same however many principals there are
        # (a scan comparing each in constant time cost 0.5 ms a call with 10,000), and a
        # guess's timing tells nothing of a token, only of digests it cannot invert.
        self._by_digest: dict[bytes, Principal] = {}
        self._by_name: dict[str, Principal] = {}
        for principal, token in principals:
            self._by_name[principal.name] = principal
            if token:
                self._by_digest[token if isinstance(token, bytes) else _digest(token)] = principal
        self.certificate_names = certificate_names

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Authenticator)
            and self._by_digest == other._by_digest
            and self._by_name == other._by_name
            and self.certificate_names == other.certificate_names
        )

    @classmethod
    def from_file(cls, path: str | Path, *, certificate_names: bool = False) -> Authenticator:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the credentials file {path}: {error}") from None
        return cls.from_mapping(data, certificate_names=certificate_names)

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], *, certificate_names: bool = False
    ) -> Authenticator:
        if not isinstance(data, Mapping):
            raise ValueError('the credentials must be a JSON object, with "principals": a list')
        principals = data.get("principals") or []
        if not isinstance(principals, list):
            raise ValueError("principals must be a list of objects")
        entries = []
        for index, item in enumerate(principals):
            if not isinstance(item, Mapping):
                raise ValueError(f"principals[{index}] must be an object")
            name = str(item.get("name") or "")
            if not name:
                raise ValueError(f"principals[{index}] has no name")
            agents = item.get("agents") or []
            if not isinstance(agents, list) or not all(isinstance(a, str) for a in agents):
                raise ValueError(f"principals[{index}].agents must be a list of agent ids")
            token, digest = item.get("token"), item.get("token_sha256")
            if token is not None and digest is not None:
                raise ValueError(f"principals[{index}]: a token or its token_sha256, not both")
            if token is not None and (not isinstance(token, str) or len(token) < 16):
                raise ValueError(f"principals[{index}].token must be at least 16 characters")
            known: str | bytes | None = token
            if digest is not None:
                known = _from_hex(digest)
                if known is None:
                    raise ValueError(
                        f"principals[{index}].token_sha256 must be a SHA-256 digest: 64 hex digits"
                    )
            entries.append(
                (Principal(name, frozenset(agents), bool(item.get("admin", False))), known)
            )
        return cls(entries, certificate_names=certificate_names)

    def authenticate(self, token: str | None, certificate_names: Iterable[str] = ()) -> Principal:
        """The principal a call's credentials name; raises UnauthenticatedError otherwise.

        A token, when present, decides (a wrong token is refused even with a good
        certificate); otherwise the verified client certificate's names are looked up.
        """
        if token:
            found = self._by_digest.get(_digest(token))
            if found is None:
                raise UnauthenticatedError("the token is not valid")
            return found
        if self.certificate_names:
            for name in certificate_names:
                known = self._by_name.get(name)
                if known is not None:
                    return known
            for name in certificate_names:
                return Principal(name, frozenset({name}))
        raise UnauthenticatedError(
            "credentials required: a bearer token in the authorization metadata"
            + (" or a client certificate" if self.certificate_names else "")
        )


# -- the credentials file, written -------------------------------------------------------------


def new_token() -> str:
    """A bearer token: 256 random bits, URL-safe text."""
    return secrets.token_urlsafe(32)


def token_sha256(token: str) -> str:
    """What a credentials file keeps of a token (``token_sha256``): its digest, which
    authenticates whoever sends the token but is no token itself."""
    return _digest(token).hex()


def _from_hex(digest: object) -> bytes | None:
    if not isinstance(digest, str) or len(digest) != 64:
        return None
    try:
        return bytes.fromhex(digest)
    except ValueError:
        return None


def _holds(entry: Mapping[str, Any], token: str) -> bool:
    """Whether a principal's entry is the one of ``token`` (kept as itself or its digest)."""
    return entry.get("token") == token or entry.get("token_sha256") == token_sha256(token)


def principal_entry(name: str, agents: Iterable[str], *, admin: bool, token: str) -> JSONDict:
    """A principal's entry of the credentials file, keeping the token's digest alone: the
    file (on every server) holds no token a reader of it could send."""
    entry: JSONDict = {
        "name": name,
        "token_sha256": token_sha256(token),
        "agents": sorted(set(agents)),
    }
    if admin:
        entry["admin"] = True
    return entry


def rotated(data: Mapping[str, Any], name: str, token: str) -> JSONDict:
    """The credentials with ``token`` added for principal ``name`` beside the ones it has
    (same agents, same admin): the first step of a rotation, while its clients still send
    the old one. KeyError when no principal is so named."""
    principals = list(data.get("principals") or [])
    known = [p for p in principals if p.get("name") == name]
    if not known:
        raise KeyError(name)
    latest = known[-1]
    entry = principal_entry(
        name, latest.get("agents") or [], admin=bool(latest.get("admin")), token=token
    )
    return {**data, "principals": [*principals, entry]}


def retired(data: Mapping[str, Any], name: str, keep: str) -> tuple[JSONDict, int]:
    """The credentials with every token of principal ``name`` but ``keep`` taken out (the
    last step of a rotation, once its clients send the new one), and how many went. KeyError
    when ``keep`` is not one of its tokens."""
    principals = list(data.get("principals") or [])
    if not any(p.get("name") == name and _holds(p, keep) for p in principals):
        raise KeyError(name)
    kept = [p for p in principals if p.get("name") != name or _holds(p, keep)]
    return {**data, "principals": kept}, len(principals) - len(kept)
