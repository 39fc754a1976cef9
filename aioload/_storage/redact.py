"""URLs as messages show them: the credentials a URL carries (``user:password@``) replaced
by ``***``, in errors, log lines, notes and each shard sample's ``__url__``.

A URL's credentials are sent to its server (``Authorization: Basic``), never shown:
``https://ann:s3cret@host/a.tar`` is shown as ``https://***@host/a.tar``. :func:`redact`
takes a URL or any text that holds URLs (an error message that quotes a redirect's target),
so a message can be redacted once, where it is made, whatever it quotes.
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?<![A-Za-z0-9+.\-])([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#@\s'\"<>]*@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL in it replaced by ``***``."""
    if "@" not in text:  # the common case, at the cost of one scan
        return text
    return _USERINFO.sub(r"\1***@", text)
