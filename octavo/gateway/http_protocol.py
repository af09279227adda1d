"""uvicorn's HTTP protocol with a bound on a request's head (request line and
headers), counted while the bytes arrive.

uvicorn's httptools parser keeps a header however long it grows (a 64 MiB
header is read whole before the app sees the request); this protocol answers
431 and closes the connection as soon as a head passes ``max_header_bytes``.
Without httptools (the ``gateway`` extra) uvicorn's h11 parser is used, bounded
at the same size by h11 itself, which answers such a head with a plain 400.
"""
from __future__ import annotations

import json
from typing import Any, Union

from octavo.openai.errors import error_body


def protocol(max_header_bytes: int) -> Union[type, str]:
    """What uvicorn's ``http`` setting takes: the bounded httptools protocol, or "h11"."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"

    class BoundedHeadProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # between requests and until the blank line that ends the headers
            self._head_bytes = 0
            self._tail = b""  # the last bytes seen, for a blank line cut across two reads

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else end + 4 - len(self._tail)
                self._tail = seen[-3:]
                if self._head_bytes > max_header_bytes:
                    self._refuse()
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head, self._head_bytes, self._tail = True, 0, b""
            super().on_message_complete()

        def _refuse(self) -> None:
            message = f"request line and headers larger than {max_header_bytes} bytes"
            body = json.dumps(error_body(431, message, code="headers_too_large")).encode()
            head = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
            self.transport.write(head + body)
            self.transport.close()

    return BoundedHeadProtocol
