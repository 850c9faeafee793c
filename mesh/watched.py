"""Security files (TLS certificates, keys and CAs; the credentials file): read, checked, and
read again when they change.

They are renewed in place: cert-manager rewrites a Kubernetes Secret, whose volume in each pod
changes under its process; certbot or an operator replaces the files; a leaked token is taken
out of the credentials file. Servers and clients keep them in a :class:`WatchedFiles`, which
says when they changed and what they hold now, checked as they will be used; files that
changed into something that cannot be used (written halfway, a key that is not its
certificate's, JSON cut short) are said once, and what was read before stays in use. No gRPC
here: :mod:`mesh.security` makes credentials of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Generic, TypeVar

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

logger = logging.getLogger("mesh.security")

T = TypeVar("T")

Stamp = tuple[tuple[int, int, int, int] | None, ...]


def read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None


def _certificates(data: bytes) -> list[x509.Certificate]:
    """The PEM certificates in ``data`` (ValueError: none)."""
    return x509.load_pem_x509_certificates(data)


def _public(key: object) -> bytes:
    return key.public_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def pair_problem(cert: bytes, key: bytes) -> str | None:
    """Why ``cert`` and ``key`` are not a PEM certificate (or a chain, the certificate first)
    and its unencrypted private key; None when they are."""
    try:
        leaf = _certificates(cert)[0]
    except ValueError:
        return "the certificate is not PEM"
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except TypeError:
        return "the key is encrypted (TLS here takes an unencrypted key)"
    except (ValueError, UnsupportedAlgorithm):
        return "the key is not a PEM private key"
    if _public(private.public_key()) != _public(leaf.public_key()):
        return "the key is not the certificate's"
    return None


def read_pair(cert_path: str, key_path: str, cert_flag: str, key_flag: str) -> tuple[bytes, bytes]:
    """A certificate and its key, read and checked (ValueError naming the flags)."""
    cert, key = read_file(cert_path), read_file(key_path)
    problem = pair_problem(cert, key)
    if problem is not None:
        raise ValueError(
            f"{cert_flag} {cert_path} and {key_flag} {key_path} are not a PEM certificate and "
            f"its private key: {problem}"
        )
    return cert, key


def read_roots(path: str, flag: str = "--tls-ca") -> bytes:
    """A CA file (one certificate or a bundle), read and checked."""
    data = read_file(path)
    try:
        _certificates(data)
    except ValueError:
        raise ValueError(f"{flag} {path} is not a PEM certificate") from None
    return data


def valid_until(cert: bytes) -> datetime:
    """When the first certificate of ``cert`` expires."""
    return _certificates(cert)[0].not_valid_after_utc


class WatchedFiles(Generic[T]):
    """Files, and what :attr:`load` makes of them (raising ValueError when it cannot), read
    again when they change. :meth:`changed` looks (a ``stat`` of each file) and answers
    what they hold when it differs from what it answered before; it may be called from any
    thread (gRPC calls a server's from its own, before each TLS handshake)."""

    def __init__(self, what: str, paths: Sequence[str], load: Callable[[], T]) -> None:
        self.what = what
        self.paths = tuple(paths)
        self.load = load
        self._lock = threading.Lock()
        self._looked = time.monotonic()
        self._stamp = self._stamp_now()
        self.current: T = load()

    def _stamp_now(self) -> Stamp:
        # A Secret's volume swaps a symlink: stat() follows it, to a new inode.
        stamps: list[tuple[int, int, int, int] | None] = []
        for path in self.paths:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(stamps)

    def changed(self, every: float = 0.0) -> T | None:
        """What the files hold, when they changed since the last look into something usable
        and other than :attr:`current` (which it becomes); None otherwise. With ``every``,
        it looks (a stat of each file) only when the last look is that many seconds old: a
        caller on a hot path asks at each call, and pays a clock read."""
        if every and time.monotonic() - self._looked < every:
            return None
        with self._lock:
            self._looked = time.monotonic()
            stamp = self._stamp_now()
            if stamp == self._stamp:
                return None
            self._stamp = stamp
            try:
                loaded = self.load()
            except ValueError as error:
                logger.warning(
                    "%s changed into what cannot be used, so what was read before stays in use: %s",
                    self.what,
                    error,
                    extra={"event": {"category": "security", "files": list(self.paths)}},
                )
                return None
            if loaded == self.current:  # (touched, or a look in the middle of a change)
                return None
            self.current = loaded
        return loaded
