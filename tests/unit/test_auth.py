"""Principals and credentials without sockets: who a token or a certificate names."""

from __future__ import annotations

import hashlib
import re

import pytest

from mesh.core.auth import Authenticator, Principal
from mesh.core.errors import UnauthenticatedError


def test_among_many_principals_each_token_names_its_own() -> None:
    tokens = [f"token-of-agent-{i:06d}-x" for i in range(10_000)]
    auth = Authenticator.from_mapping(
        {
            "principals": [
                {"name": f"p{i}", "token": token, "agents": [f"Agent{i}"]}
                for i, token in enumerate(tokens)
            ]
            + [{"name": "ops", "token": "operator-token-0123456789", "admin": True}]
        }
    )
    for i in (0, 1, 4_999, 9_999):
        assert auth.authenticate(tokens[i]) == Principal(f"p{i}", frozenset({f"Agent{i}"}))
    assert auth.authenticate("operator-token-0123456789").admin
    for wrong in (tokens[7][:-1] + "y", tokens[7] + " ", tokens[7].upper()):
        with pytest.raises(UnauthenticatedError, match="the token is not valid"):
            auth.authenticate(wrong)


def test_a_token_decides_before_a_certificate() -> None:
    auth = Authenticator.from_mapping(
        {"principals": [{"name": "PaymentAgent", "agents": ["PaymentAgent"]}]},
        certificate_names=True,
    )
    assert auth.authenticate(None, ["PaymentAgent"]).agents == {"PaymentAgent"}
    assert auth.authenticate(None, ["HotelAgent"]) == Principal(
        "HotelAgent", frozenset({"HotelAgent"})
    )
    with pytest.raises(UnauthenticatedError, match="the token is not valid"):
        auth.authenticate("not-a-token-of-anyone-0123", ["PaymentAgent"])
    with pytest.raises(UnauthenticatedError, match="credentials required"):
        Authenticator().authenticate(None, ["PaymentAgent"])


def test_a_token_may_be_kept_as_its_digest() -> None:
    """What `agentmesh credentials` writes: a file of digests authenticates the tokens, and
    holds none of them."""
    digest = hashlib.sha256(b"payment-token-0123456789").hexdigest()
    auth = Authenticator.from_mapping(
        {"principals": [{"name": "payment", "token_sha256": digest, "agents": ["PaymentAgent"]}]}
    )
    assert auth.authenticate("payment-token-0123456789").agents == {"PaymentAgent"}
    with pytest.raises(UnauthenticatedError, match="the token is not valid"):
        auth.authenticate(digest)  # (the digest is no token)


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ({"token_sha256": "abc"}, "principals[0].token_sha256 must be a SHA-256 digest"),
        ({"token_sha256": "z" * 64}, "principals[0].token_sha256 must be a SHA-256 digest"),
        (
            {"token": "payment-token-0123456789", "token_sha256": "a" * 64},
            "principals[0]: a token or its token_sha256, not both",
        ),
    ],
)
def test_a_digest_that_is_none_is_refused(entry: dict[str, str], said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(said)):
        Authenticator.from_mapping({"principals": [{"name": "payment", **entry}]})
