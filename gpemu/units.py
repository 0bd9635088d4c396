"""How gpemu writes sizes and addresses for people: one byte formatter, one URL redaction.

Every message that shows a size (OOM errors, ``memory_summary()``, the end-of-run summary,
``gpemu show``) and every message that shows a URL (database, sharing manager, broker) goes
through these two functions, so the same quantity always reads the same way and no password
ever reaches a log.
"""

from __future__ import annotations

__all__ = ["format_bytes", "redact_url", "KiB", "MiB", "GiB"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def format_bytes(nbytes: float) -> str:
    """PyTorch's style: ``'20.00 MiB'``, ``'31.74 GiB'``, ``'512 bytes'`` (binary units)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def redact_url(url: str | None) -> str:
    """``url`` with its password replaced by ``***`` (``amqp://user:***@host/vhost``).

    Works for any ``scheme://user:password@host...`` URL (AMQP, SQLAlchemy, HTTP). The last ``@``
    ends the credentials, so a password containing ``@`` is hidden whole."""
    if not url or "@" not in url or "://" not in url:
        return url or ""
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"
