"""A replica's URL, checked where it is given."""
from __future__ import annotations

import re
import urllib.parse

_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)*")


def normalize_url(url: str) -> str:
    """``http://host:port`` without a trailing slash; a bare ``host:port`` gets http://.

    Strict, because a URL that cannot be fetched must be refused where it is
    given (command line, config, admin API), not found out by the probe loop:
    a host name or IP literal, a port in 1-65535, an optional plain path, and
    no credentials, query or fragment."""
    url = url.strip()
    if not url:
        raise ValueError("replica URL must not be empty")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"replica URL must be http(s): {url!r}")
    url = url.rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"replica URL is malformed ({exc}): {url!r}") from None
    netloc = parts.netloc
    if "@" in netloc or "?" in url or "#" in url:
        raise ValueError(f"replica URL must be scheme://host[:port][/path], without credentials, query or "
                         f"fragment: {url!r}")
    host, port = netloc, ""
    if ":" in netloc and not netloc.endswith("]"):
        host, _, port = netloc.rpartition(":")
    if not _HOST.fullmatch(host):
        raise ValueError(f"replica URL has no valid host name or IP address: {url!r}")
    if ":" in netloc.rpartition("]")[2] and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"replica URL's port must be 1-65535: {url!r}")
    if not _PATH.fullmatch(parts.path):
        raise ValueError(f"replica URL's path may hold only letters, digits and . _ ~ - /: {url!r}")
    return url
