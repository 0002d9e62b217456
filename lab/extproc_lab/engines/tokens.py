"""A deterministic toy tokenizer for the simulated engines.

The simulator needs token ids, not meaning: the same text must give the same ids in every process
(the KV prefix cache and a router's prefix-aware scoring both hash token ids), and token counts
should be about those of a real BPE tokenizer (~4 characters of English per token) so that prompt
lengths, and so prefill times, look realistic. Ids come from blake2b, never from Python's `hash()`,
which is salted per process.

Text is split into words (runs of letters/digits/underscore) and single punctuation characters;
whitespace only separates pieces. A word of up to five characters is one piece; a longer word is cut
into four-character pieces (that mix gives ~4 characters per token on English prose; all-short or
all-long pieces give ~3.4 or ~4.4). Each piece maps to an id in [0, PIECE_VOCAB). Chat templates use
a few special ids above that range.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from hashlib import blake2b
from typing import Any

PIECE_VOCAB = 50_000  # ids of text pieces (and of generated tokens) lie in [0, PIECE_VOCAB)
WORD_CHARS = 5  # a word up to this long is one piece
PIECE_CHARS = 4  # a longer word is cut into pieces of this many characters

# Special tokens of the chat template, outside the piece range.
MSG_START = PIECE_VOCAB  # starts a message, followed by the role
MSG_SEP = PIECE_VOCAB + 1  # ends the role, content follows
MSG_END = PIECE_VOCAB + 2  # ends a message
VOCAB_SIZE = PIECE_VOCAB + 3

_PIECES = re.compile(r"\w+|[^\w\s]")


@lru_cache(maxsize=65_536)
def piece_id(piece: str) -> int:
    """The id of one piece: stable across processes and Python versions."""
    digest = blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % PIECE_VOCAB


def tokenize(text: str) -> list[int]:
    """Token ids of `text`: about one per four characters of English prose."""
    ids: list[int] = []
    for match in _PIECES.finditer(text):
        word = match.group()
        if len(word) <= WORD_CHARS:
            ids.append(piece_id(word))
        else:
            ids.extend(piece_id(word[i : i + PIECE_CHARS]) for i in range(0, len(word), PIECE_CHARS))
    return ids


def content_text(content: Any) -> list[str]:
    """The text parts of an OpenAI message `content`: a string, or a list of parts where only
    `{"type": "text"}` parts count (images and audio carry no text tokens here); None is empty."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
    return texts


def message_tokens(role: str, content: Any) -> list[int]:
    """One message in the fixed template: MSG_START role MSG_SEP content MSG_END."""
    ids = [MSG_START, *tokenize(role), MSG_SEP]
    for text in content_text(content):
        ids.extend(tokenize(text))
    ids.append(MSG_END)
    return ids


def chat_to_tokens(messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat, message after message, so a chat and its continuation share a prefix.

    With `add_generation_prompt` the ids end with the header of an assistant message (MSG_START
    "assistant" MSG_SEP), exactly as the assistant's reply will start when it is sent back in the
    next turn: turn N's prompt is a token prefix of turn N+1's, as with real chat templates.
    """
    ids: list[int] = []
    for message in messages:
        ids.extend(message_tokens(str(message.get("role", "")), message.get("content")))
    if add_generation_prompt:
        ids.extend([MSG_START, *tokenize("assistant"), MSG_SEP])
    return ids


_CONSONANTS = "bdfgklmnprstvwxz"
_VOWELS = "aeiou"


def token_text(token_id: int) -> str:
    """Printable text for a generated token: a pseudo-word plus a space (4 characters), stable per id.

    Not the inverse of `tokenize`; it only gives streamed output a plausible length and shape."""
    n = token_id % PIECE_VOCAB
    c1 = _CONSONANTS[n % 16]
    v = _VOWELS[(n // 16) % 5]
    c2 = _CONSONANTS[(n // 80) % 16]
    return f"{c1}{v}{c2} "


class Recount:
    """An engine whose tokenizer counts differently from this module's: each text piece becomes
    `scale` engine tokens on average (0 or 1 for a scale below 1, more for a larger one), chosen per
    piece id so the same text always gives the same ids and a prompt's continuation keeps its
    prefix (the engines' prefix caches and a router's prefix hashes still line up). Template ids
    pass through. `scale` = engine tokens / this tokenizer's (~bytes/4): 1/1.75 for an engine whose
    tokens are whole words of 3-9 letters, 2 for one that counts pairs of characters."""

    def __init__(self, scale: float, salt: int = 0) -> None:
        if not scale > 0:
            raise ValueError("scale must be positive")
        self.scale = scale
        self.salt = salt
        self._pieces: dict[int, tuple[int, ...]] = {}

    def _piece(self, token: int) -> tuple[int, ...]:
        digest = blake2b(f"{self.salt}:{token}".encode(), digest_size=16).digest()
        whole = int(self.scale)
        extra = int.from_bytes(digest[:8], "little") / 2**64 < self.scale - whole
        n = whole + int(extra)
        base = int.from_bytes(digest[8:], "little")
        out = tuple((base + 7919 * j) % PIECE_VOCAB for j in range(n))
        self._pieces[token] = out
        return out

    def __call__(self, ids: Iterable[int]) -> list[int]:
        if self.scale == 1.0:
            return list(ids)
        pieces = self._pieces
        out: list[int] = []
        for t in ids:
            if t >= PIECE_VOCAB:
                out.append(t)
                continue
            p = pieces.get(t)
            out.extend(self._piece(t) if p is None else p)
        return out
