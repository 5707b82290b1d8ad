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


def _openssl() -> str:
    openssl = shutil.which("openssl")
    if openssl is None:
        make_certificate(Path("."))  # skips (or fails under CI) with the reason
    assert openssl is not None
    return openssl


def make_ca(folder: Path, name: str = "twopc test CA") -> tuple[Path, Path]:
    """A throwaway certificate authority: (certificate, key) in ``folder``."""
    openssl = _openssl()
    folder.mkdir(parents=True, exist_ok=True)
    cert, key = folder / "ca.pem", folder / "ca.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert),
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def issue(ca: tuple[Path, Path], folder: Path, common_name: str, *sans: str) -> TlsConfig:
    """A certificate for ``common_name`` (and the subject alternative names ``sans``, e.g.
    ``DNS:localhost``) signed by ``ca``; returned with the CA as a `TlsConfig`."""
    openssl = _openssl()
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / common_name.replace("/", "_")
    cert, key, csr = (stem.with_suffix(s) for s in (".pem", ".key", ".csr"))
    ext = stem.with_suffix(".ext")
    ext.write_text(f"subjectAltName={','.join(sans)}\n" if sans else "\n")
    subprocess.run(
        [openssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-subj", f"/CN={common_name}", "-keyout", str(key), "-out", str(csr)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    subprocess.run(
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-days", "1", "-out", str(cert), "-extfile", str(ext)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TlsConfig(certfile=str(cert), keyfile=str(key), cafile=str(ca[0]))
