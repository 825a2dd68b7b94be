"""The request-size limits every HTTP route enforces before a request reaches the engine (each a 400 /
422 with its own message; docs/security.md lists them with the body, header and sampling limits)."""

from __future__ import annotations

MAX_STOP_STRING_CHARS = 1024  # per stop string (OpenAI and TGI routes)
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids in one logit_bias
MAX_MESSAGES = 4096  # messages in one chat request
MAX_CACHE_SALT_CHARS = 256
