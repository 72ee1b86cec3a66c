"""Shared-token authentication of store and transport connections.

When a job has a token (``DISTCOMM_AUTH_TOKEN``, or ``auth_token=`` given to
:class:`~distcomm.store.TCPStore` / ``init_process_group``), every store and
TCP transport connection runs a challenge-response handshake: each side
sends a fresh random nonce and proves that it knows the token with
``HMAC-SHA256(token, label || nonces || context)``.  Both sides prove it
(mutual authentication), the token itself never crosses the wire, and each
proof is bound to its role and protocol by ``label``, so it cannot be
replayed elsewhere.  Wire formats: :mod:`.tcp_protocol` and
:mod:`distcomm.transport.tcp_wire`.

Tokens are opaque strings; :func:`new_token` draws one.  An empty token
(``auth_token=""``) means "no authentication", even when the environment
variable is set.  Nothing is encrypted: authentication keeps foreign
processes out, it does not hide the traffic.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator

from ..errors import DistAuthenticationError, DistTypeError

__all__ = [
    "ENV_VAR",
    "NONCE_BYTES",
    "MAC_BYTES",
    "DistAuthenticationError",
    "new_token",
    "resolve_token",
    "using_token",
    "nonce",
    "proof",
    "verify",
    "RefusalLog",
]

#: Environment variable holding the job's token.
ENV_VAR = "DISTCOMM_AUTH_TOKEN"
#: Bytes of each side's random challenge.
NONCE_BYTES = 32
#: Bytes of a proof (HMAC-SHA256).
MAC_BYTES = 32

TokenLike = str | bytes | None


def new_token() -> str:
    """A fresh random token (256 bits, hexadecimal), e.g. for ``DISTCOMM_AUTH_TOKEN``."""
    return secrets.token_hex(32)


_override = threading.local()


@contextlib.contextmanager
def using_token(token: TokenLike) -> Iterator[None]:
    """Within the block (this thread), ``resolve_token(None)`` returns ``token``.

    ``init_process_group(auth_token=...)`` uses it so the stores and
    transports it creates pick the token up.  ``None`` changes nothing.
    """
    if token is None:
        yield
        return
    previous = getattr(_override, "token", None)
    _override.token = _as_bytes(token)
    try:
        yield
    finally:
        _override.token = previous


def resolve_token(token: TokenLike = None) -> bytes | None:
    """The token to use: ``token`` if given, else :func:`using_token`'s, else the environment.

    Returns ``None`` when there is none (no authentication).
    """
    if token is not None:
        raw = _as_bytes(token)
    else:
        raw = getattr(_override, "token", None)
        if raw is None:
            raw = os.environ.get(ENV_VAR, "").strip().encode()
    return raw or None


def _as_bytes(token: str | bytes) -> bytes:
    if isinstance(token, str):
        return token.strip().encode()
    if isinstance(token, (bytes, bytearray, memoryview)):
        return bytes(token)
    raise DistTypeError(f"auth_token must be a str or bytes, got {type(token).__name__}")


def nonce() -> bytes:
    """A fresh random challenge."""
    return os.urandom(NONCE_BYTES)


def proof(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """``HMAC-SHA256(key, label || len(part) || part || ...)``."""
    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "big"))
        mac.update(part)
    return mac.digest()


def verify(expected: bytes, got: bytes) -> bool:
    """Constant-time comparison of two proofs."""
    return hmac.compare_digest(expected, got)


class RefusalLog:
    """Warnings about refused or dropped connections, at most ``burst`` per ``window`` seconds.

    A port scanner or a misconfigured job must not flood the log: past the
    burst, refusals are counted and summed up in one line when the window ends.
    """

    def __init__(self, logger: logging.Logger, what: str, burst: int = 20, window: float = 60.0) -> None:
        self._log = logger
        self._what = what
        self._burst = burst
        self._window = window
        self._lock = threading.Lock()
        self._start = 0.0
        self._logged = 0
        self._suppressed = 0
        #: Every refusal reported, logged or not.
        self.total = 0

    def warn(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            summary = 0
            if now - self._start >= self._window:
                summary, self._start, self._logged, self._suppressed = self._suppressed, now, 0, 0
            emit = self._logged < self._burst
            if emit:
                self._logged += 1
            else:
                self._suppressed += 1
        if summary:
            self._log.warning("%s: %d more refused or dropped connections were not logged",
                              self._what, summary)
        if emit:
            self._log.warning(fmt, *args)
