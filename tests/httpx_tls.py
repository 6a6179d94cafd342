"""httpx builds a TLS context for every client it makes, reading certifi's CA bundle (~40 ms):
every top-level httpx.get / post / stream pays that. The tests make thousands of such calls to
plain-HTTP servers (health polls, metrics, one-off requests); one shared default context
leaves what each call does unchanged and drops the cost. Contexts for any other settings are
made as before."""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from httpx._transports import default as transports

_make = httpx.create_ssl_context


@functools.cache
def _default_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return _make()  # reads the same two variables


def _shared_ssl_context(
    verify: ssl.SSLContext | str | bool = True, cert: object = None, trust_env: bool = True
) -> ssl.SSLContext:
    if verify is True and cert is None and trust_env:
        return _default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    return _make(verify=verify, cert=cert, trust_env=trust_env)


@contextmanager
def shared_default_tls_context() -> Iterator[None]:
    """While it lasts, httpx clients with the default TLS settings share one context."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transports, "create_ssl_context", _shared_ssl_context)
        yield
