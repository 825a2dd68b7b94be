"""The admin key check: ``Authorization: Bearer <admin key>`` (constant time), 401 otherwise; with no
admin key configured the admin API answers 404."""

from __future__ import annotations

import hashlib
import secrets

from fastapi import Request

from pagedserve.entrypoints.context import get_context
from pagedserve.entrypoints.serving.errors import APIError

ADMIN_OFF = "The admin API is off: start the server with --admin-key KEY (or $PAGEDSERVE_ADMIN_KEY) to use it."


def admin_key_matches(header: str | None, admin_key: str) -> bool:
    """Whether an Authorization header carries ``admin_key`` as its bearer token (compared in constant time)."""
    if header is None:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(token.strip().encode()).digest()
    return secrets.compare_digest(digest, hashlib.sha256(admin_key.encode()).digest())


async def require_admin(raw_request: Request) -> None:
    """The dependency of every admin route."""
    admin_key = get_context(raw_request).config.admin_key
    if admin_key is None:
        raise APIError(ADMIN_OFF, 404, code="admin_api_disabled")
    if not admin_key_matches(raw_request.headers.get("authorization"), admin_key):
        raise APIError(
            "Invalid or missing admin key. Pass it as 'Authorization: Bearer <admin-key>'.",
            401,
            code="invalid_admin_key",
            type="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
