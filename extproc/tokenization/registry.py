"""Model name -> tokenizer, and the tokenization of one request.

A request's prompt (a completions `prompt`, or chat `messages` rendered with the model's template)
is cut into segments at special tokens (see backends.py), segments already seen are taken from the
LRU cache and only the new ones are encoded. Encoding more than `offload_chars` of new text runs on
a thread pool (the Rust encoders release the GIL), so a long prompt never stalls the event loop;
small ones are encoded inline, where a thread hop would cost more than the work.

Models without a tokenizer get an estimate (`source == "estimate"`, no ids): see estimate_tokens().

Context: with `max_model_len` in a model's spec, a prompt that cannot fit raises PromptTooLong, before
it is encoded when the bound `ceil(text bytes / longest token bytes)` already exceeds the limit (a
15 MB prompt would otherwise cost seconds of encoding; see backends.py for why the bound holds), and
after it when the exact count does. A prompt that may fit is never refused.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import threading
from array import array
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from hashlib import blake2b
from pathlib import Path
from typing import Any, Literal, TypedDict, Unpack

from extproc.tokenization.backends import LoadedTokenizer
from extproc.tokenization.cache import CacheKey, CacheStats, SegmentCache
from extproc.tokenization.config import DEFAULT_BYTES_PER_TOKEN, WILDCARD, TokenizerSpec, parse_specs
from extproc.tokenization.hashing import block_hashes

# New text to encode above which the work goes to the thread pool: encoding this much on the event
# loop already stalls it far longer than a thread hop costs, while much smaller texts cost less inline
# than the hop.
OFFLOAD_CHARS = 4 * 1024
MIN_SEGMENT_CHARS = 128  # smaller pieces are merged with the next: fewer cache entries, less overhead
BUILTIN_ESTIMATE = "<estimate>"  # tokenizer name reported when no spec (not even "*") applies

Source = Literal["tokenizer", "estimate"]


def estimate_tokens(text: str, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN) -> int:
    """ceil(UTF-8 bytes / bytes_per_token). Bytes, not characters, because BPE vocabularies are
    built over bytes: English averages ~4 bytes (= characters) a token, while CJK text, 3 bytes a
    character at ~1-1.5 tokens a character, would be undercounted 3-4x by characters / 4."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(size / bytes_per_token)


class PromptTooLong(ValueError):
    """The prompt has more tokens than the model's `max_model_len`: exactly `tokens`, or at least
    `tokens` when it was refused on the bound, before encoding (`exact` False)."""

    def __init__(self, model: str | None, tokens: int, max_model_len: int, *, exact: bool) -> None:
        count = tokens if exact else f"at least {tokens}"
        super().__init__(f"prompt of {count} tokens exceeds max_model_len {max_model_len} of {model!r}")
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.exact = exact


def min_tokens(text: str, max_token_bytes: int) -> int:
    """A proven lower bound on the tokens of `text` for a tokenizer whose tokens stand for at most
    `max_token_bytes` bytes each."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // max_token_bytes)


# What a chat template writes around each message (role markers, separators), in characters: so
# that many short messages count as the work they are to render, not as their few characters.
MESSAGE_OVERHEAD_CHARS = 64


def _input_chars(inputs: PromptInputs) -> int:
    """Characters of prompt text the inputs carry (message contents, text parts, and each message's
    share of the template), without rendering."""
    prompt = inputs.get("prompt")
    if prompt is not None:
        return len(prompt)
    messages = inputs.get("messages") or ()
    total = MESSAGE_OVERHEAD_CHARS * len(messages)
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += MESSAGE_OVERHEAD_CHARS * len(content)  # each part is rendered too
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    total += len(text)
    return total


class PromptInputs(TypedDict, total=False):
    """What to tokenize: exactly one of `prompt` (completions) or `messages` (chat, rendered with the
    model's template, with `tools` and `template_kwargs` passed to it). `add_special_tokens` defaults as
    in vLLM: True for a prompt (BOS), False for messages (the template writes its own)."""

    prompt: str
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool | None
    template_kwargs: Mapping[str, Any] | None


@dataclass(slots=True)
class TokenizedPrompt:
    """One request's tokens. `token_ids` is empty for an estimate; `text` is the prompt as encoded
    (the rendered chat), kept for callers that fall back to text hashing on estimates."""

    model: str
    tokenizer: str  # the spec used: the model's own, "*", or BUILTIN_ESTIMATE
    source: Source
    token_count: int
    token_ids: array[int] = field(repr=False)
    text: str = field(repr=False)
    segments: int = 0
    cached_segments: int = 0
    cached_tokens: int = 0  # tokens taken from the cache rather than encoded
    offloaded: bool = False  # encoded on the thread pool

    @property
    def exact(self) -> bool:
        return self.source == "tokenizer"

    def block_hashes(
        self, block_size: int, max_blocks: int | None = None, *, seed: bytes = b""
    ) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` (none for an estimate)."""
        return block_hashes(self.token_ids, block_size, max_blocks, seed=seed)


@dataclass(slots=True)
class _Plan:
    """A request between cache lookup and encoding: segment ids found, or None where still to encode."""

    tok: LoadedTokenizer
    text: str
    add_special_tokens: bool
    keys: list[CacheKey]
    found: list[array[int] | None]
    missing: dict[CacheKey, str]  # new segments, deduplicated

    @property
    def missing_chars(self) -> int:
        return sum(len(s) for s in self.missing.values())


class TokenizerRegistry:
    """Maps model names to tokenizers (loaded lazily, or all at once with load_all) and tokenizes
    requests with a shared segment cache. Thread-safe; the async API is meant for the event loop."""

    def __init__(
        self,
        specs: Mapping[str, TokenizerSpec] | None = None,
        *,
        cache: SegmentCache | None = None,
        offload_chars: int = OFFLOAD_CHARS,
        min_segment_chars: int = MIN_SEGMENT_CHARS,
        executor: Executor | None = None,
        max_workers: int | None = None,
    ) -> None:
        self._specs = dict(specs or {})
        self.cache = cache if cache is not None else SegmentCache()
        self.offload_chars = offload_chars
        self.min_segment_chars = min_segment_chars
        self._executor = executor
        self._own_executor = executor is None
        self._max_workers = max_workers or min(4, os.cpu_count() or 1)
        self._loaded: dict[str, LoadedTokenizer] = {}
        self._lock = threading.Lock()
        self._builtin = LoadedTokenizer(TokenizerSpec(BUILTIN_ESTIMATE, "estimate"))

    # --- models ------------------------------------------------------------------------------------

    @property
    def models(self) -> list[str]:
        """Configured names ("*" included)."""
        return list(self._specs)

    def spec_name(self, model: str | None) -> str:
        """The spec serving `model`: its own, else "*", else BUILTIN_ESTIMATE."""
        if model is not None and model in self._specs:
            return model
        return WILDCARD if WILDCARD in self._specs else BUILTIN_ESTIMATE

    def is_exact(self, model: str | None) -> bool:
        """Whether `model` has a real tokenizer (its counts are exact)."""
        name = self.spec_name(model)
        return name != BUILTIN_ESTIMATE and self._specs[name].kind != "estimate"

    def load_all(self) -> None:
        """Load every tokenizer now (at start), so file errors surface before traffic does."""
        for name in self._specs:
            self._get(name)

    def _get(self, name: str) -> LoadedTokenizer:
        tok = self._loaded.get(name)
        if tok is not None:
            return tok
        if name == BUILTIN_ESTIMATE:
            return self._builtin
        with self._lock:
            tok = self._loaded.get(name)
            if tok is None:
                tok = LoadedTokenizer(self._specs[name])
                self._loaded[name] = tok
        return tok

    def _pool(self) -> Executor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix="tokenize"
                )
            return self._executor

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    def close(self) -> None:
        """Stop the thread pool if this registry made it."""
        if self._own_executor and self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # --- requests ----------------------------------------------------------------------------------

    def render(
        self,
        model: str | None,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat prompt text `model`'s template renders (raises ChatTemplateError)."""
        tok = self._get(self.spec_name(model))
        return tok.select_template(tools).render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    def tokenize(self, model: str | None, **inputs: Unpack[PromptInputs]) -> TokenizedPrompt:
        """Tokenize a completions `prompt` or chat `messages` (see PromptInputs), on the calling
        thread. Raises ChatTemplateError when the template rejects the messages, PromptTooLong
        when the prompt cannot fit the model's `max_model_len`."""
        tok, text, add_special = self._prepare_checked(model, inputs)
        if tok.encoder is None:
            return self._estimate(model, tok, text)
        plan = self._plan(tok, text, add_special)
        return self._checked(tok, self._finish(model, plan, self._encode(plan), offloaded=False))

    async def tokenize_async(self, model: str | None, **inputs: Unpack[PromptInputs]) -> TokenizedPrompt:
        """As tokenize(), for the event loop: encoding more than `offload_chars` of new text, and a
        first lazy load, run on the thread pool."""
        name = self.spec_name(model)
        if name not in self._loaded and name != BUILTIN_ESTIMATE:
            await asyncio.get_running_loop().run_in_executor(self._pool(), self._get, name)
        # Rendering 15 MB of messages copies it several times, and bounding a long prompt's tokens
        # may encode it: not on the event loop. A plain prompt without a limit needs neither.
        checks = inputs.get("messages") is not None or self._get(name).spec.max_model_len is not None
        if checks and _input_chars(inputs) > self.offload_chars:
            prepare = functools.partial(self._prepare_checked, model, inputs)
            tok, text, add_special = await asyncio.get_running_loop().run_in_executor(self._pool(), prepare)
        else:
            tok, text, add_special = self._prepare_checked(model, inputs)
        if tok.encoder is None:
            return self._estimate(model, tok, text)
        keyed = None
        if len(text) > self.offload_chars:  # hashing a long text into cache keys holds the loop too
            loop = asyncio.get_running_loop()
            keyed = await loop.run_in_executor(self._pool(), self._segment_keys, tok, text)
        plan = self._plan(tok, text, add_special, keyed)
        if plan.missing_chars > self.offload_chars:
            encoded = await asyncio.get_running_loop().run_in_executor(self._pool(), self._encode, plan)
            return self._checked(tok, self._finish(model, plan, encoded, offloaded=True))
        return self._checked(tok, self._finish(model, plan, self._encode(plan), offloaded=False))

    # --- steps -------------------------------------------------------------------------------------

    def _prepare_checked(self, model: str | None, inputs: PromptInputs) -> tuple[LoadedTokenizer, str, bool]:
        """_prepare(), then refuse a prompt whose lower bound already exceeds max_model_len."""
        tok, text, add_special = self._prepare(model, inputs)
        limit, longest = tok.spec.max_model_len, tok.max_token_bytes
        if limit is not None and longest is not None:
            bound = min_tokens(text, longest)
            if bound > limit:
                raise PromptTooLong(model, bound, limit, exact=False)
        return tok, text, add_special

    @staticmethod
    def _checked(tok: LoadedTokenizer, result: TokenizedPrompt) -> TokenizedPrompt:
        limit = tok.spec.max_model_len
        if limit is not None and result.token_count > limit:
            raise PromptTooLong(result.model, result.token_count, limit, exact=True)
        return result

    def _prepare(self, model: str | None, inputs: PromptInputs) -> tuple[LoadedTokenizer, str, bool]:
        prompt, messages = inputs.get("prompt"), inputs.get("messages")
        tools = inputs.get("tools")
        add_special_tokens = inputs.get("add_special_tokens")
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        tok = self._get(self.spec_name(model))
        if messages is not None:
            text = tok.select_template(tools).render(
                messages,
                tools=tools,
                add_generation_prompt=inputs.get("add_generation_prompt", True),
                template_kwargs=inputs.get("template_kwargs"),
            )
            return tok, text, bool(add_special_tokens)
        assert prompt is not None
        return tok, prompt, add_special_tokens is None or add_special_tokens

    def _estimate(self, model: str | None, tok: LoadedTokenizer, text: str) -> TokenizedPrompt:
        count = estimate_tokens(text, tok.spec.bytes_per_token)
        return TokenizedPrompt(model or "", tok.name, "estimate", count, array("I"), text)

    def _plan(
        self,
        tok: LoadedTokenizer,
        text: str,
        add_special_tokens: bool,
        keyed: tuple[list[str], list[tuple[str, bytes]]] | None = None,
    ) -> _Plan:
        if add_special_tokens and not tok.wraps:
            # The post-processor is not a fixed prefix/suffix: encode whole, uncached.
            return _Plan(tok, text, True, [], [], {})
        segments, keys = keyed or self._segment_keys(tok, text)
        found = self.cache.get_many(keys)
        missing = {key: seg for key, seg, ids in zip(keys, segments, found, strict=True) if ids is None}
        return _Plan(tok, text, add_special_tokens, keys, found, missing)

    def _segment_keys(self, tok: LoadedTokenizer, text: str) -> tuple[list[str], list[tuple[str, bytes]]]:
        """The prompt's segments and their cache keys: pure, so a long text's run on the pool."""
        segments = tok.segments(text, self.min_segment_chars)
        name = tok.name
        keys = [
            (name, blake2b(s.encode("utf-8", "surrogatepass"), digest_size=16).digest()) for s in segments
        ]
        return segments, keys

    @staticmethod
    def _encode(plan: _Plan) -> list[array[int]]:
        """The slow part (runs on the pool for long texts): encode the new segments."""
        assert plan.tok.encoder is not None
        if not plan.keys:
            return plan.tok.encoder.encode([plan.text], add_special_tokens=True)
        return plan.tok.encoder.encode(list(plan.missing.values())) if plan.missing else []

    def _finish(
        self, model: str | None, plan: _Plan, encoded: list[array[int]], *, offloaded: bool
    ) -> TokenizedPrompt:
        tok = plan.tok
        if not plan.keys:  # whole-text path
            ids = encoded[0]
            return TokenizedPrompt(
                model or "", tok.name, "tokenizer", len(ids), ids, plan.text, 1, 0, 0, offloaded
            )
        fresh = dict(zip(plan.missing, encoded, strict=True))
        if fresh:
            self.cache.put_many(list(fresh.items()))
        ids = array("I", tok.prefix_ids) if plan.add_special_tokens else array("I")
        cached_segments = cached_tokens = 0
        for key, hit in zip(plan.keys, plan.found, strict=True):
            if hit is not None:
                cached_segments += 1
                cached_tokens += len(hit)
                ids.extend(hit)
            else:
                ids.extend(fresh[key])
        if plan.add_special_tokens:
            ids.extend(tok.suffix_ids)
        return TokenizedPrompt(
            model or "",
            tok.name,
            "tokenizer",
            len(ids),
            ids,
            plan.text,
            len(plan.keys),
            cached_segments,
            cached_tokens,
            offloaded,
        )


def from_config(
    raw: Mapping[str, Any] | None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    load: bool = True,
    cache_max_entries: int = 65_536,
    cache_max_bytes: int = 64 * 1024 * 1024,
    offload_chars: int = OFFLOAD_CHARS,
    executor: Executor | None = None,
) -> TokenizerRegistry:
    """A registry from the service YAML's `tokenizers:` mapping. Relative paths resolve against
    `base_dir` (the config file's folder). With `load`, every tokenizer is read now, so a bad file
    fails at start. Raises ValueError naming the offending key."""
    specs = parse_specs(raw, base_dir=Path(base_dir) if base_dir is not None else None)
    registry = TokenizerRegistry(
        specs,
        cache=SegmentCache(cache_max_entries, cache_max_bytes),
        offload_chars=offload_chars,
        executor=executor,
    )
    if load:
        registry.load_all()
    return registry
