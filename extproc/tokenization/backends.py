"""Loaded tokenizers: Hugging Face `tokenizers` files and tiktoken rank files, both local only.

Segmentation (why the per-segment cache is exact): both libraries split the text at special/added
tokens *before* running the model, and encode the pieces between them independently. So cutting the
text just before a special token and encoding the parts separately gives the same ids as encoding
it whole, provided the token cannot strip whitespace to its left (`lstrip`) nor needs word
boundaries (`single_word`), and the text is matched raw (`normalized=False`); only such tokens are
cut points. Chat templates put a special token at each message boundary (`<|im_start|>`,
`<|start_header_id|>`, `<|eot_id|>`, `[INST]`...), so the segments follow the messages. Every
tokenizer is checked at load on probe texts; if whole and segmented encodings differ, it is
encoded whole (still exact, but without per-segment reuse) and a warning is logged. Without
special tokens in the text (plain completions prompts), the prompt is one segment.

Post-processing (BOS/EOS added with add_special_tokens=True) is not applied per segment: it is
detected once at load as fixed leading/trailing ids and added around the concatenation.

A lower bound on any text's token count, without encoding it (`max_token_bytes`): every token stands
for at most as many bytes of (normalized) text as its longest vocabulary entry, added tokens
included, measured as UTF-8 (a byte-level or byte-fallback entry is at least as long in UTF-8 as the
bytes it stands for). A normalizer may shrink the text: Unicode forms and lowercasing by at most 4x
(a 4-byte character becomes a 1-byte one); prepending and non-shrinking replacements not at all; for
any other normalizer (stripping, BERT cleaning, precompiled maps) no bound is claimed.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from extproc.tokenization.chat_template import (
    SPECIAL_TOKEN_KEYS,
    ChatTemplate,
    iter_template_choices,
    special_token_text,
)
from extproc.tokenization.config import TokenizerSpec

log = logging.getLogger(__name__)

# cl100k_base's split pattern: the default when a .tiktoken file comes without `pat_str`.
CL100K_PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
    r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


class _HFEncoder:
    """A `tokenizers.Tokenizer`, with truncation and padding off (a count must see every token)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        tok.no_truncation()
        tok.no_padding()
        self._tok = tok
        # The batch entry points release the GIL while encoding (plain `encode` does not), so a long
        # prompt encoded on a worker thread does not stall the event loop; `_fast` skips offsets.
        self._batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
        added = [t for t in tok.get_added_tokens_decoder().values() if not t.normalized and not t.single_word]
        self.matchable = [t.content for t in added]
        self.cuttable = {t.content for t in added if not t.lstrip}
        self.max_token_bytes = self._max_token_bytes()

    def _max_token_bytes(self) -> int | None:
        normalizer = self._tok.normalizer
        shrink = 1 if normalizer is None else _shrink_factor(json.loads(normalizer.__getstate__()))
        if shrink is None:
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=0)
        return longest * shrink if longest else None

    def encode(self, pieces: Sequence[str], add_special_tokens: bool = False) -> list[array[int]]:
        try:
            encodings = self._batch(list(pieces), add_special_tokens=add_special_tokens)
        except (TypeError, UnicodeEncodeError):  # lone surrogates from JSON escapes
            fixed = [p.encode("utf-8", "replace").decode("utf-8") for p in pieces]
            encodings = self._batch(fixed, add_special_tokens=add_special_tokens)
        return [array("I", e.ids) for e in encodings]


def _load_tiktoken_ranks(path: Path, where: str) -> dict[bytes, int]:
    """A .tiktoken file: one `base64(token) rank` per line (what tiktoken.load.load_tiktoken_bpe
    reads, without its download cache)."""
    ranks: dict[bytes, int] = {}
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error) as exc:
                raise ValueError(f"{where}: line {lineno} is not 'base64-token rank': {exc}") from exc
    if not ranks:
        raise ValueError(f"{where}: no tokens in {path}")
    return ranks


_UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})


def _shrink_factor(spec: Any) -> int | None:
    """How many bytes of input text a byte of this normalizer's output may stand for (None: no bound)."""
    if not isinstance(spec, dict):
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = spec.get("pattern"), spec.get("content")
        if isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and isinstance(content, str):
            return 1 if len(content.encode()) >= len(pattern["String"].encode()) else None
        return None
    if kind in _UNICODE_NORMALIZERS:
        return 4
    return None


class _TiktokenEncoder:
    """A tiktoken Encoding built from a local rank file. Special tokens in the text are encoded as
    special tokens, as an engine does when it renders a chat template."""

    def __init__(self, spec: TokenizerSpec, where: str) -> None:
        import tiktoken

        assert spec.path is not None
        ranks = _load_tiktoken_ranks(spec.path, f"{where}.tiktoken_file")
        try:
            self._enc = tiktoken.Encoding(
                spec.name,
                pat_str=spec.pat_str or CL100K_PAT_STR,
                mergeable_ranks=ranks,
                special_tokens=dict(spec.special_tokens),
            )
        except Exception as exc:  # bad regex, id collisions
            raise ValueError(f"{where}: cannot build a tiktoken encoding: {exc}") from exc
        self.matchable = list(spec.special_tokens)
        self.cuttable = set(self.matchable)
        longest = max(map(len, ranks), default=0)  # tiktoken has no normalizer
        self.max_token_bytes: int | None = max([longest, *(len(t.encode()) for t in self.matchable)])

    def encode(self, pieces: Sequence[str], add_special_tokens: bool = False) -> list[array[int]]:
        # `encode` releases the GIL for the BPE work; tiktoken adds no BOS/EOS.
        return [array("I", self._enc.encode(p, allowed_special="all")) for p in pieces]


class LoadedTokenizer:
    """One spec, loaded: its encoder (None for estimates), chat templates and segmentation rules."""

    def __init__(self, spec: TokenizerSpec, *, prefix: str = "tokenizers") -> None:
        where = f"{prefix}.{spec.name}"
        self.spec = spec
        self.name = spec.name
        self.encoder: _HFEncoder | _TiktokenEncoder | None
        try:
            if spec.kind == "hf":
                assert spec.path is not None
                self.encoder = _HFEncoder(spec.path)
            elif spec.kind == "tiktoken":
                self.encoder = _TiktokenEncoder(spec, where)
            else:
                self.encoder = None
        except ValueError:
            raise
        except Exception as exc:  # the tokenizers library raises its own Exception subclasses
            raise ValueError(f"{where}: cannot load {spec.path}: {exc}") from exc
        self.templates = _load_templates(spec, where)
        self._split: re.Pattern[str] | None = None
        self._cuttable: frozenset[str] = frozenset()
        self.prefix_ids = array("I")
        self.suffix_ids = array("I")
        self.wraps = True  # add_special_tokens is prefix/suffix ids around the text's own
        self.max_token_bytes = self.encoder.max_token_bytes if self.encoder is not None else None
        """The most bytes of prompt text one token can stand for (None: no bound; see above)."""
        if self.encoder is not None:
            if self.encoder.matchable:
                alternatives = sorted(self.encoder.matchable, key=len, reverse=True)  # leftmost-longest
                self._split = re.compile("|".join(re.escape(t) for t in alternatives))
                self._cuttable = frozenset(self.encoder.cuttable)
            self._check_segmentation()
            self._detect_wrapping()

    @property
    def segmented(self) -> bool:
        return self._split is not None

    def segments(self, text: str, min_chars: int) -> list[str]:
        """`text` cut just before special tokens, each piece at least `min_chars` long (but the
        last). Greedy left to right, so two texts with a common prefix are cut alike within it:
        the pieces of a conversation's earlier turns are found again in its next request."""
        split = self._split
        if split is None or not text:
            return [text]
        out: list[str] = []
        start = 0
        cuttable = self._cuttable
        for match in split.finditer(text):
            cut = match.start()
            if cut - start >= max(min_chars, 1) and match.group() in cuttable:
                out.append(text[start:cut])
                start = cut
        out.append(text[start:])
        return out

    def select_template(self, tools: Any) -> ChatTemplate:
        """transformers' choice among named templates: "tool_use" when tools are given, else "default"."""
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates["default"]

    def _check_segmentation(self) -> None:
        assert self.encoder is not None
        if self._split is None:
            return
        cuts = sorted(self._cuttable)[:4]
        if not cuts:
            self._split = None
            return
        probes = [
            "".join(f"{t}user\nHello there, how are you?{t}\n {t}  x\n\n{t}{t} tail  " for t in cuts),
            "start " + " \n".join(f"{t}assistant\n\n  Sure.  {t}\n" for t in cuts) + "end",
        ]
        for probe in probes:
            whole = self.encoder.encode([probe])[0]
            pieces = self.encoder.encode(self.segments(probe, 0))
            joined = array("I")
            for ids in pieces:
                joined.extend(ids)
            if joined != whole:
                log.warning(
                    "tokenizer %s: encoding at special-token boundaries differs from whole-text encoding; "
                    "encoding whole prompts (no per-segment cache)",
                    self.name,
                )
                self._split = None
                return

    def _detect_wrapping(self) -> None:
        """add_special_tokens=True as fixed ids before and after the text's own (e.g. BOS)."""
        assert self.encoder is not None
        probes = ["hello world", "x\n y"]
        found: tuple[array[int], array[int]] | None = None
        for probe in probes:
            plain = self.encoder.encode([probe], add_special_tokens=False)[0]
            full = self.encoder.encode([probe], add_special_tokens=True)[0]
            where = _find(full, plain)
            if where < 0:
                self.wraps = False
                return
            pair = (full[:where], full[where + len(plain) :])
            if found is not None and pair != found:
                self.wraps = False
                return
            found = pair
        assert found is not None
        self.prefix_ids, self.suffix_ids = found


def _find(haystack: array[int], needle: array[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i : i + n] == needle:
            return i
    return -1


def _load_templates(spec: TokenizerSpec, where: str) -> dict[str, ChatTemplate]:
    """Named chat templates (at least "default"): the spec's .jinja file, else tokenizer_config's
    `chat_template`, else built-in ChatML."""
    from extproc.tokenization.chat_template import DEFAULT_CHAT_TEMPLATE

    config: Mapping[str, Any] = {}
    if spec.tokenizer_config is not None:
        try:
            config = json.loads(spec.tokenizer_config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{where}.tokenizer_config: cannot read JSON from {spec.tokenizer_config}: {exc}"
            ) from exc
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}.tokenizer_config: must hold a JSON object")
    special: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        if config.get(key) is not None:
            text = special_token_text(config[key])
            if text is None:
                raise ValueError(
                    f"{where}.tokenizer_config: {key} must be a string or an object with 'content'"
                )
            special[key] = text

    sources: dict[str, str] = {}
    if spec.chat_template is not None:
        sources["default"] = spec.chat_template.read_text(encoding="utf-8")
    elif config.get("chat_template") is not None:
        try:
            sources = dict(iter_template_choices(config["chat_template"]))
        except ValueError as exc:
            raise ValueError(f"{where}.tokenizer_config: {exc}") from exc
        if "default" not in sources:
            raise ValueError(f"{where}.tokenizer_config: chat_template list has no 'default' template")
    else:
        sources["default"] = DEFAULT_CHAT_TEMPLATE
    templates: dict[str, ChatTemplate] = {}
    for name, source in sources.items():
        try:
            templates[name] = ChatTemplate(source, special, spec.content_format)
        except ValueError as exc:
            raise ValueError(f"{where}: chat template {name!r}: {exc}") from exc
    return templates
