"""Security files read again when they change: what a server or client takes, and what it
says."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from mesh.certs import write_dev_certificates
from mesh.watched import WatchedFiles, read_pair, valid_until


def test_files_are_taken_again_only_when_what_they_hold_changed_into_something_usable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = (write_dev_certificates(tmp_path / name) for name in ("first", "second"))
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(first["server"].read_bytes())
    key.write_bytes(first["server_key"].read_bytes())
    files = WatchedFiles(
        "the test's TLS files",
        [str(cert), str(key)],
        lambda: read_pair(str(cert), str(key), "--tls-cert", "--tls-key"),
    )
    assert files.current == (first["server"].read_bytes(), first["server_key"].read_bytes())
    assert files.changed() is None

    cert.write_bytes(cert.read_bytes())  # touched: the same certificate
    assert files.changed() is None

    caplog.set_level(logging.INFO, logger="mesh.security")
    cert.write_bytes(second["server"].read_bytes())  # the key not yet renewed with it
    assert files.changed() is None
    assert files.changed() is None  # (said once)
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the test's TLS files changed into what cannot be used, so what was read before stays in "
        f"use: --tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private "
        "key: the key is not the certificate's"
    ]
    assert files.current[0] == first["server"].read_bytes()

    key.write_bytes(second["server_key"].read_bytes())
    renewed = (second["server"].read_bytes(), second["server_key"].read_bytes())
    assert files.changed() == renewed
    assert files.current == renewed
    assert files.changed() is None

    key.unlink()  # (a moment of a renewal by hand): the last good files stay in use
    assert files.changed() is None
    assert files.current == renewed
    assert "cannot read" in caplog.records[-1].getMessage()


def test_a_chain_says_when_its_first_certificate_expires(tmp_path: Path) -> None:
    issued = write_dev_certificates(tmp_path, days=30)
    chain = issued["server"].read_bytes() + issued["ca"].read_bytes()
    left = valid_until(chain) - datetime.now(UTC)
    assert timedelta(days=29, hours=23) < left <= timedelta(days=30)


def test_asked_at_each_call_it_looks_only_as_often_as_told(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    files = WatchedFiles("the test's token file", [str(token)], token.read_text)
    token.write_text("second")
    assert files.changed(every=60) is None  # (looked as it was made: not again for a minute)
    assert files.current == "first"
    assert files.changed() == "second"
