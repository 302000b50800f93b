"""The API key kvpool's own HTTP clients send (demo, chat, replay): ``KVPOOL_API_KEY``.

The variable takes the router's syntax (``KEY`` or ``TENANT=KEY``, comma-separated);
a client sends the first entry's key.
"""

from __future__ import annotations

import os

API_KEY_ENV = "KVPOOL_API_KEY"


def client_key(explicit: str = "") -> str:
    """``explicit`` if given, else the first key of ``KVPOOL_API_KEY``; "" for none."""
    value = explicit or os.environ.get(API_KEY_ENV, "")
    first = value.split(",", 1)[0].strip()
    return first.partition("=")[2].strip() if "=" in first else first


def auth_headers(explicit: str = "") -> dict[str, str]:
    key = client_key(explicit)
    return {"Authorization": f"Bearer {key}"} if key else {}
