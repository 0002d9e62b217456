"""Tokenization for the request path: token counts and ids per request, and block hashes over them.

A low layer: imports nothing else from `extproc`. Tokenizers are read from local files only
(Hugging Face tokenizer.json, tiktoken rank files); chat messages are rendered with the model's
sandboxed chat template as transformers renders them; a per-segment LRU cache makes each turn of a
conversation encode only its new text; long prompts are encoded off the event loop. Models without
a tokenizer get a flagged estimate.

    registry = from_config(cfg.get("tokenizers"), base_dir=config_dir)
    result = await registry.tokenize_async(model, messages=body["messages"])
    hashes = result.block_hashes(16, max_blocks=512)
"""

from extproc.tokenization.cache import CacheStats, SegmentCache
from extproc.tokenization.chat_template import ChatTemplateError
from extproc.tokenization.config import DEFAULT_BYTES_PER_TOKEN, TokenizerSpec
from extproc.tokenization.hashing import block_hashes
from extproc.tokenization.registry import (
    PromptInputs,
    PromptTooLong,
    TokenizedPrompt,
    TokenizerRegistry,
    estimate_tokens,
    from_config,
)

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "CacheStats",
    "ChatTemplateError",
    "PromptInputs",
    "PromptTooLong",
    "SegmentCache",
    "TokenizedPrompt",
    "TokenizerRegistry",
    "TokenizerSpec",
    "block_hashes",
    "estimate_tokens",
    "from_config",
]
