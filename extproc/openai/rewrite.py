"""Changing one top-level field of a JSON request body on its way to the engine.

The body is forwarded byte for byte everywhere else; the one change made here is the engine priority
(`engine_priority:` in the service YAML). Most bodies do not carry the field, and for those the value
is spliced in before the closing brace: one copy, no parse, whatever the body's size. A body whose
bytes hold the quoted field name (the client set it, or a string value happens to be that word) is
parsed and written again, so that the gateway's value is the only one: engines disagree about
duplicate keys (Python's json keeps the last, serde refuses the document).
"""

from __future__ import annotations

import orjson

_WHITESPACE = b" \t\r\n"


def set_field(body: bytes, name: str, value: int) -> bytes:
    """`body` (a JSON object, as the parser has checked) with `name` set to `value`."""
    key = orjson.dumps(name)
    if key in body:
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
