"""A throwaway self-signed certificate for ``localhost`` and 127.0.0.1, made with the openssl
command, for tests that run the protocol over TLS."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from messaging.auth import TlsConfig


def make_certificate(folder: Path) -> TlsConfig:
    """Certificate, key and CA (the certificate itself) in ``folder``. Without openssl the test
    skips, or fails under ``CI=true``: CI must not go green by skipping."""
    openssl = shutil.which("openssl")
    if openssl is None:
        message = "the openssl command is not installed: cannot make a test certificate"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert),
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TlsConfig(certfile=str(cert), keyfile=str(key), cafile=str(cert))
