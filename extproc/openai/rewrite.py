"""Changing one top-level field of a JSON request body on its way to the engine.

The body is forwarded byte for byte everywhere else; the one change made here is the engine priority
(`engine_priority:` in the service YAML). Most bodies do not carry the field, and for those the value
is spliced in before the closing brace: one copy, no parse, whatever the body's size. A body whose
bytes hold the quoted field name (the client set it, or a string value happens to be that word) is
parsed and written again, so that the gateway's value is the only one: engines disagree about
duplicate keys (Python's json keeps the last, serde refuses the document).

"Holds the quoted field name" is read as JSON reads strings: `"priorit\\u0079"` is the key
`"priority"` too. A body without a backslash can spell the name one way only (a plain byte search);
one with escapes is searched with a pattern that allows each character written either way instead.
"""

from __future__ import annotations

import functools
import re

import orjson

_WHITESPACE = b" \t\r\n"
# JSON's two-character escapes (RFC 8259, section 7), besides \uXXXX which any character may use.
_SHORT_ESCAPES = {'"': b'\\"', "\\": b"\\\\", "/": b"\\/", "\b": b"\\b", "\f": b"\\f", "\n": b"\\n"}
_SHORT_ESCAPES.update({"\r": b"\\r", "\t": b"\\t"})


def set_field(body: bytes, name: str, value: int) -> bytes:
    """`body` (a JSON object, as the parser has checked) with `name` set to `value`."""
    key = orjson.dumps(name)
    # Without a backslash the name has one spelling (a fast byte search); with one, any (a pattern).
    named = _spelled(name).search(body) is not None if b"\\" in body else key in body
    if named:
        doc = orjson.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("the request body is not a JSON object")
        doc[name] = value
        return orjson.dumps(doc)
    close = body.rfind(b"}")
    if close < 0:
        raise ValueError("the request body is not a JSON object")
    last = close - 1
    while last >= 0 and body[last] in _WHITESPACE:
        last -= 1
    if last < 0:
        raise ValueError("the request body is not a JSON object")
    member = key + b":" + str(value).encode()
    sep = b"" if body[last] == ord("{") else b","
    return b"".join((memoryview(body)[: last + 1], sep, member, memoryview(body)[close:]))


@functools.lru_cache(maxsize=8)
def _spelled(name: str) -> re.Pattern[bytes]:
    """The JSON string `"name"` however it is written: each character as itself (UTF-8), as its short
    escape, or as `\\uXXXX` escapes (hex digits in either case; a surrogate pair beyond the BMP)."""
    parts = [b'"']
    for char in name:
        forms = []
        if char not in _SHORT_ESCAPES or char == "/":  # `/` may stand as itself; `"` and `\` may not
            forms.append(re.escape(char.encode()))
        if char in _SHORT_ESCAPES:
            forms.append(re.escape(_SHORT_ESCAPES[char]))
        units = char.encode("utf-16-be")
        escape = b""
        for i in range(0, len(units), 2):
            digits = f"{units[i]:02x}{units[i + 1]:02x}"
            escape += rb"\\u" + b"".join(
                f"[{d}{d.upper()}]".encode() if d.isalpha() else d.encode() for d in digits
            )
        forms.append(escape)
        parts.append(b"(?:" + b"|".join(forms) + b")")
    parts.append(b'"')
    return re.compile(b"".join(parts))
