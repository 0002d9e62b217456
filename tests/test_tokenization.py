"""extproc.tokenization: template parity with transformers, exact segment caching, tiktoken from a
local file, estimates, the async path, config errors and block hashes.

Every tokenizer here is built by the tests (a small BPE trained with `tokenizers`, a .tiktoken file
written by hand): nothing is downloaded. transformers is only a reference, imported inside tests.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import itertools
import json
import math
import random
from array import array
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from hashlib import blake2b
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from extproc.tokenization import (
    ChatTemplateError,
    TokenizerRegistry,
    block_hashes,
    estimate_tokens,
    from_config,
)
from extproc.tokenization.backends import CL100K_PAT_STR
from extproc.tokenization.config import parse_specs

# --- fixtures: tokenizers and templates -----------------------------------------------------------

_WORD_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part model server token cache prefix request latency "
    "engine batch queue kernel memory tensor gradient python function return value system user assistant"
)
WORDS = _WORD_TEXT.split()

SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "<|endoftext|>",
]


def prose(rng: random.Random, n_words: int) -> str:
    out: list[str] = []
    for i in range(n_words):
        word = rng.choice(WORDS)
        if i % 11 == 0:
            word = word.capitalize()
        out.append(word + ("." if i % 11 == 10 else ",") if rng.random() < 0.12 else word)
        if rng.random() < 0.03:
            out.append("\n\n")
    return " ".join(out)


def corpus(seed: int = 0, lines: int = 1500) -> list[str]:
    rng = random.Random(seed)
    extra = [
        "déjà vu café naïve",
        "東京 大阪 京都",
        "emoji 🎉 ok",
        "x = f(y) + 42 # {json: [1, 2]}",
        "  indented\n\tcode",
    ]
    return [prose(rng, 40) + " " + rng.choice(extra) for _ in range(lines)]


def train_bytelevel(path: Path, vocab_size: int = 2000) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(path))
    return path


def train_metaspace(path: Path) -> Path:
    """A sentencepiece-like BPE (Metaspace, prepend only at the start): offsets matter to it."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        corpus(1), trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>", *SPECIALS])
    )
    tok.add_tokens([AddedToken("<mask>", lstrip=True, normalized=False, special=True)])
    tok.save(str(path))
    return path


LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    '    {%- set system_message = "" %}\n'
    "{%- endif %}\n"
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    "{%- if tools is not none %}\n"
    '    {{- "You have access to these tools:\\n" }}\n'
    "    {%- for t in tools %}\n"
    '        {{- t | tojson(indent=4) }}\n        {{- "\\n\\n" }}\n'
    "    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    '{{- "<|eot_id|>" }}\n'
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

# Qwen-style ChatML that understands content parts (so the parts reach it as a list).
CHATML = (
    "{%- for message in messages %}\n"
    "{%- if loop.first and message.role != 'system' %}\n"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}\n"
    "<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'text' %}{{ part.text }}"
    "{% elif part.type == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)


def added(content: str) -> dict[str, Any]:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


CONFIGS: dict[str, dict[str, Any]] = {
    "llama3": {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "chatml": {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral": {"chat_template": MISTRAL, "bos_token": added("<s>"), "eos_token": added("</s>")},
}

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  You are terse.  "},
        {"role": "user", "content": "What is a KV cache?"},
        {"role": "assistant", "content": "Stored keys and values.", "tool_calls": None},
        {"role": "user", "content": "And a prefix cache?\n\nExplain."},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this, please."}],
        },
        {"role": "assistant", "content": "Café au lait, 東京 🎉"},
        {"role": "user", "content": [{"type": "text", "text": "  spaced  \n"}]},
    ],
    [
        {"role": "user", "content": "a<|eot_id|>b"},  # a special token typed by the user counts as one
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "\n\n\t x"},
    ],
]


def conversations_for(template: str) -> list[list[dict[str, Any]]]:
    if template == "mistral":  # no system role there
        return [c for c in CONVERSATIONS if c[0]["role"] != "system"]
    return CONVERSATIONS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    train_bytelevel(d / "tokenizer.json")
    train_metaspace(d / "metaspace.json")
    for name, config in CONFIGS.items():
        (d / f"{name}_config.json").write_text(json.dumps(config), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def registry(model_dir: Path) -> Iterator[TokenizerRegistry]:
    raw = {
        name: {"tokenizer_json": "tokenizer.json", "tokenizer_config": f"{name}_config.json"}
        for name in CONFIGS
    }
    reg = from_config(raw, base_dir=model_dir)
    yield reg
    reg.close()


def whole_ids(
    model_dir: Path, text: str, add_special_tokens: bool = False, file: str = "tokenizer.json"
) -> list[int]:
    return Tokenizer.from_file(str(model_dir / file)).encode(text, add_special_tokens=add_special_tokens).ids


def reference(model_dir: Path, template: str) -> Any:
    """transformers' tokenizer over the same files: the reference renderer."""
    transformers = pytest.importorskip("transformers")
    config = dict(CONFIGS[template])
    chat_template = config.pop("chat_template")
    kwargs = {k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), **kwargs)
    tok.chat_template = chat_template
    return tok


def joined_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our documented normalisation for string templates: text parts joined with "\\n"."""
    out = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, list):
            m = {**m, "content": "\n".join(p["text"] for p in c if p.get("type") == "text")}
        out.append(m)
    return out


# --- template parity with transformers ------------------------------------------------------------


@pytest.mark.parametrize("template", list(CONFIGS))
def test_template_parity_with_transformers(
    registry: TokenizerRegistry, model_dir: Path, template: str
) -> None:
    ref = reference(model_dir, template)
    string_template = template != "chatml"
    for messages in conversations_for(template):
        ref_messages = joined_parts(messages) if string_template else messages
        expected = ref.apply_chat_template(ref_messages, tokenize=False, add_generation_prompt=True)
        assert registry.render(template, messages) == expected
        result = registry.tokenize(template, messages=messages)
        expected_ids = ref.apply_chat_template(
            ref_messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert list(result.token_ids) == expected_ids
        assert result.exact and result.source == "tokenizer" and result.token_count == len(expected_ids)


def test_tools_render_with_transformers_tojson(registry: TokenizerRegistry, model_dir: Path) -> None:
    ref = reference(model_dir, "llama3")
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": {"type": "string"}}}}]
    messages = CONVERSATIONS[1]
    expected = ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "météo" in expected  # tojson keeps non-ASCII, indents
    assert registry.render("llama3", messages, tools=tools) == expected


def test_named_templates_pick_tool_use_like_transformers(model_dir: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    named = [
        {"name": "default", "template": "D:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "T:{{ tools | tojson }}"},
    ]
    (tmp_path / "cfg.json").write_text(json.dumps({"chat_template": named}), encoding="utf-8")
    reg = from_config(
        {
            "m": {
                "tokenizer_json": str(model_dir / "tokenizer.json"),
                "tokenizer_config": str(tmp_path / "cfg.json"),
            }
        }
    )
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    ref.chat_template = {t["name"]: t["template"] for t in named}
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"name": "f"}]
    assert reg.render("m", msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert reg.render("m", msgs, tools=tools) == ref.apply_chat_template(
        msgs, tools=tools, tokenize=False, add_generation_prompt=True
    )


def test_raise_exception_is_a_chat_template_error(registry: TokenizerRegistry, model_dir: Path) -> None:
    jinja2 = pytest.importorskip("jinja2")
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="must alternate"):
        registry.tokenize("mistral", messages=bad)
    ref = reference(model_dir, "mistral")
    with pytest.raises(jinja2.exceptions.TemplateError, match="must alternate"):
        ref.apply_chat_template(bad, tokenize=False)


def test_sandbox_blocks_attribute_escapes(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "evil.jinja").write_text(
        "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
    )
    reg = from_config(
        {
            "m": {
                "tokenizer_json": str(model_dir / "tokenizer.json"),
                "chat_template": str(tmp_path / "evil.jinja"),
            }
        }
    )
    with pytest.raises(ChatTemplateError):
        reg.render("m", [{"role": "user", "content": "x"}])


# --- segment cache: exact, and reused across turns -----------------------------------------------


def long_conversation(turns: int, seed: int = 7, words: int = 60) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = []
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": prose(rng, words)})
    return msgs


@pytest.mark.parametrize("template", list(CONFIGS))
def test_multi_turn_reuses_earlier_messages_and_stays_exact(model_dir: Path, template: str) -> None:
    reg = from_config(
        {
            template: {
                "tokenizer_json": str(model_dir / "tokenizer.json"),
                "tokenizer_config": str(model_dir / f"{template}_config.json"),
            }
        }
    )
    convo = long_conversation(11)
    previous = None
    for k in range(1, len(convo) + 1, 2):  # each request: the history plus one more exchange
        result = reg.tokenize(template, messages=convo[:k])
        assert list(result.token_ids) == whole_ids(model_dir, result.text)  # concatenation == whole text
        if previous is not None:
            # Everything the previous request sent is found again, but its last segment (the
            # generation prompt, now followed by the reply).
            assert result.cached_segments >= previous.segments - 1
            new_tokens = result.token_count - result.cached_tokens
            new_text_tokens = len(whole_ids(model_dir, convo[k - 2]["content"] + convo[k - 1]["content"]))
            assert new_tokens <= new_text_tokens + 64  # headers and the previous last segment
        previous = result
    stats = reg.cache_stats()
    assert stats.hits > 0 and stats.entries > 0 and 0 < stats.hit_rate < 1
    # The same request again: everything from the cache.
    again = reg.tokenize(template, messages=convo)
    assert again.cached_segments == again.segments and again.cached_tokens == again.token_count


def test_segments_exact_on_random_texts(model_dir: Path) -> None:
    """Whole-text and per-segment encodings agree for byte-level and Metaspace tokenizers, on texts
    full of special tokens, whitespace runs and an lstrip token (never cut there)."""
    rng = random.Random(3)
    pieces = [
        *SPECIALS,
        "<mask>",
        " <mask>",
        " ",
        "  ",
        "\n",
        "\n\n ",
        "\t",
        "hello",
        " world",
        "Café",
        "東京",
        "x",
        "🎉",
    ]
    for file in ("tokenizer.json", "metaspace.json"):
        reg = TokenizerRegistry(
            parse_specs({"m": {"tokenizer_json": str(model_dir / file)}}), min_segment_chars=0
        )
        assert reg.tokenize("m", prompt="a<|im_start|>b<|im_end|>").segments == 3, file  # cut, not disabled
        ref = Tokenizer.from_file(str(model_dir / file))
        for _ in range(300):
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
            for special in (False, True):
                got = reg.tokenize("m", prompt=text, add_special_tokens=special)
                assert list(got.token_ids) == ref.encode(text, add_special_tokens=special).ids, (file, text)


def test_completions_prompt_gets_bos_like_the_tokenizer(registry: TokenizerRegistry, model_dir: Path) -> None:
    text = "Once upon a time<|eot_id|> there was a model"
    assert list(registry.tokenize("llama3", prompt=text).token_ids) == whole_ids(model_dir, text, True)
    assert list(registry.tokenize("llama3", prompt=text, add_special_tokens=False).token_ids) == whole_ids(
        model_dir, text
    )


def test_cache_bounds_evict_lru(model_dir: Path) -> None:
    reg = from_config({"m": {"tokenizer_json": str(model_dir / "tokenizer.json")}}, cache_max_entries=3)
    for i in range(6):
        reg.tokenize("m", prompt=f"prompt number {i} " * 20)
    stats = reg.cache_stats()
    assert stats.entries == 3 and stats.evictions == 3 and stats.misses == 6
    reg2 = from_config({"m": {"tokenizer_json": str(model_dir / "tokenizer.json")}}, cache_max_bytes=4000)
    for i in range(20):
        reg2.tokenize("m", prompt=f"another prompt {i} " * 20)
    assert reg2.cache_stats().bytes <= 4000


# --- tiktoken --------------------------------------------------------------------------------------


def write_tiktoken(path: Path, text: str, merges: int = 300) -> dict[bytes, int]:
    """A tiny byte-level BPE rank file: 256 single bytes, then the most frequent pair merges."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(w.encode() for w in text.replace("\n", " ").split(" ") for w in (" " + w,))
    seqs = {w: [bytes([b]) for b in w] for w in words}
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for w, seq in seqs.items():
            for a, b in itertools.pairwise(seq):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        for w, seq in seqs.items():
            i, out = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return ranks


def test_tiktoken_from_local_file(tmp_path: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    ranks = write_tiktoken(tmp_path / "tiny.tiktoken", "\n".join(corpus(2, 200)))
    special = {"<|endoftext|>": 5000, "<|im_start|>": 5001, "<|im_end|>": 5002}
    reg = from_config(
        {"gpt-x": {"tiktoken_file": "tiny.tiktoken", "special_tokens": special}}, base_dir=tmp_path
    )
    ref = tiktoken.Encoding("ref", pat_str=CL100K_PAT_STR, mergeable_ranks=ranks, special_tokens=special)
    text = "The model served a request<|endoftext|> and then another one, café 東京."
    result = reg.tokenize("gpt-x", prompt=text)
    assert result.exact and list(result.token_ids) == ref.encode(text, allowed_special="all")
    assert ref.decode(list(result.token_ids)) == text
    messages = long_conversation(5, words=40)
    chat = reg.tokenize("gpt-x", messages=messages)  # built-in ChatML template
    assert chat.text.startswith("<|im_start|>user\n") and chat.text.endswith("<|im_start|>assistant\n")
    assert list(chat.token_ids) == ref.encode(chat.text, allowed_special="all")
    more = reg.tokenize("gpt-x", messages=[*messages, {"role": "assistant", "content": "ok"}])
    assert more.cached_segments >= chat.segments - 1
    assert list(more.token_ids) == ref.encode(more.text, allowed_special="all")


# --- estimates -------------------------------------------------------------------------------------


def test_estimate_is_flagged(model_dir: Path) -> None:
    reg = from_config(
        {"sim": {"tokenizer_json": str(model_dir / "tokenizer.json")}, "*": {"estimate_bytes_per_token": 3.5}}
    )
    text = "hello world, 東京"  # 13 ASCII bytes + 6 bytes of CJK
    result = reg.tokenize("unknown-model", prompt=text)
    assert result.source == "estimate" and not result.exact and result.tokenizer == "*"
    assert result.token_count == math.ceil(19 / 3.5) and len(result.token_ids) == 0
    assert result.block_hashes(4) == []
    assert reg.tokenize("sim", prompt=text).exact and reg.is_exact("sim") and not reg.is_exact("other")
    chat = reg.tokenize(None, messages=[{"role": "user", "content": "hi"}])
    assert chat.source == "estimate" and chat.token_count == estimate_tokens(chat.text, 3.5)
    # Nothing configured at all: the built-in ceil(bytes / 4).
    bare = from_config(None).tokenize("m", prompt="x" * 9)
    assert bare.source == "estimate" and bare.token_count == 3 and bare.tokenizer == "<estimate>"


# --- async -----------------------------------------------------------------------------------------


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=2)
        self.submitted = 0

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        self.submitted += 1
        return super().submit(*args, **kwargs)


async def test_long_prompt_runs_in_executor_and_matches_sync(model_dir: Path) -> None:
    executor = CountingExecutor()
    raw = {
        "m": {
            "tokenizer_json": str(model_dir / "tokenizer.json"),
            "tokenizer_config": str(model_dir / "llama3_config.json"),
        }
    }
    reg = from_config(raw, executor=executor)
    text = prose(random.Random(11), 40_000)[:200_000]
    assert len(text) == 200_000
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    result = await reg.tokenize_async("m", prompt=text)
    task.cancel()
    # Two jobs on the pool: the segments' cache keys (hashing 200 KB), then the encoding.
    assert result.offloaded and executor.submitted == 2
    assert ticks > 1  # the loop kept running while the prompt was encoded
    fresh = from_config(raw)  # no cache shared with the async run
    sync = fresh.tokenize("m", prompt=text)
    assert not sync.offloaded and list(sync.token_ids) == list(result.token_ids) == whole_ids(
        model_dir, text, True
    )
    # Small requests stay inline; chat messages too.
    small = await reg.tokenize_async("m", messages=[{"role": "user", "content": "short"}])
    assert not small.offloaded and executor.submitted == 2
    chat = await reg.tokenize_async("m", messages=[{"role": "user", "content": text}])
    assert chat.offloaded and list(chat.token_ids) == list(
        fresh.tokenize("m", messages=[{"role": "user", "content": text}]).token_ids
    )
    executor.shutdown()


async def test_async_lazy_load(model_dir: Path) -> None:
    reg = from_config({"m": {"tokenizer_json": str(model_dir / "tokenizer.json")}}, load=False)
    assert "m" not in reg._loaded
    result = await reg.tokenize_async("m", prompt="hello")
    assert result.exact and "m" in reg._loaded
    reg.close()


# --- config errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"m": {"tokenizer_json": "tokenizer.json", "colour": 1}}, r"tokenizers\.m: unknown key 'colour'"),
        ({"m": {"tokenizer_json": "missing.json"}}, r"tokenizers\.m\.tokenizer_json: no such file"),
        ({"m": {"tokenizer_json": 5}}, r"tokenizers\.m\.tokenizer_json: must be a file path string, got int"),
        ({"m": {"tiktoken_file": "nope.tiktoken"}}, r"tokenizers\.m\.tiktoken_file: no such file"),
        ({"m": "tokenizer.json"}, r"tokenizers\.m: must be a mapping, got str"),
        ({"m": {}}, r"tokenizers\.m: needs exactly one of"),
        ({"m": {"tokenizer_json": "tokenizer.json", "estimate_bytes_per_token": 4}}, r"needs exactly one of"),
        (
            {"m": {"estimate_bytes_per_token": 0}},
            r"tokenizers\.m\.estimate_bytes_per_token: must be a positive",
        ),
        ({"m": {"estimate_bytes_per_token": "4"}}, r"estimate_bytes_per_token: must be a positive"),
        ({"m": {"estimate_bytes_per_token": True}}, r"estimate_bytes_per_token: must be a positive"),
        ({"m": {"estimate_bytes_per_token": 4, "pat_str": "x"}}, r"unknown key 'pat_str'"),
        (
            {"m": {"tokenizer_json": "tokenizer.json", "content_format": "xml"}},
            r"tokenizers\.m\.content_format",
        ),
        (
            {"m": {"tokenizer_json": "tokenizer.json", "tokenizer_config": ["a"]}},
            r"tokenizers\.m\.tokenizer_config: must be",
        ),
        ([1, 2], r"tokenizers: must be a mapping"),
    ],
)
def test_config_errors_name_the_key(model_dir: Path, raw: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_config(raw, base_dir=model_dir)


def test_bad_files_fail_at_load(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizers\.m: cannot load"):
        from_config({"m": {"tokenizer_json": "broken.json"}}, base_dir=tmp_path)
    # Lazy: the same error on first use instead.
    lazy = from_config({"m": {"tokenizer_json": "broken.json"}}, base_dir=tmp_path, load=False)
    with pytest.raises(ValueError, match="cannot load"):
        lazy.tokenize("m", prompt="x")
    (tmp_path / "bad.tiktoken").write_text("aGk= 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"tokenizers\.m\.tiktoken_file: line 2"):
        from_config({"m": {"tiktoken_file": "bad.tiktoken"}}, base_dir=tmp_path)
    (tmp_path / "t.tiktoken").write_text("aGk= 0\n")
    with pytest.raises(ValueError, match=r"tokenizers\.m\.special_tokens"):
        from_config({"m": {"tiktoken_file": "t.tiktoken", "special_tokens": {"<x>": "1"}}}, base_dir=tmp_path)
    (tmp_path / "cfg.json").write_text("[1]")
    tok = str(model_dir / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizers\.m\.tokenizer_config: must hold a JSON object"):
        from_config({"m": {"tokenizer_json": tok, "tokenizer_config": "cfg.json"}}, base_dir=tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ValueError, match="no 'default' template"):
        from_config({"m": {"tokenizer_json": tok, "tokenizer_config": "cfg.json"}}, base_dir=tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        from_config({"m": {"tokenizer_json": tok, "tokenizer_config": "cfg.json"}}, base_dir=tmp_path)


# --- block hashes ----------------------------------------------------------------------------------


def test_block_hashes_chain() -> None:
    ids = list(range(100))
    hashes = block_hashes(ids, 16)
    assert len(hashes) == 6 and all(len(h) == 8 for h in hashes)  # 6 full blocks; 4 ids left over
    assert block_hashes(array("I", ids), 16) == hashes  # list or array alike
    # Block i covers the parent's hash and the block's little-endian uint32 ids.
    parent = b""
    for i, h in enumerate(hashes):
        parent = blake2b(parent + array("I", ids[i * 16 : (i + 1) * 16]).tobytes(), digest_size=8).digest()
        assert h == parent
    same_prefix = block_hashes([*ids[:40], *range(500, 560)], 16)
    assert same_prefix[:2] == hashes[:2] and same_prefix[2] != hashes[2]  # blocks 0-1 equal, block 2 differs
    first_differs = block_hashes([999, *ids[1:]], 16)
    assert all(a != b for a, b in zip(first_differs, hashes, strict=True))  # later blocks too: chained
    assert block_hashes(ids, 16, max_blocks=2) == hashes[:2]
    assert block_hashes(ids, 16, max_blocks=0) == []
    assert block_hashes(ids[:15], 16) == []
    assert block_hashes(ids, 16, seed=b"model-b")[0] != hashes[0]
    with pytest.raises(ValueError):
        block_hashes(ids, 0)
    with pytest.raises(ValueError):
        block_hashes(ids, 16, max_blocks=-1)


def test_result_block_hashes_follow_the_conversation(registry: TokenizerRegistry) -> None:
    convo = long_conversation(5)
    a = registry.tokenize("chatml", messages=convo[:3])
    b = registry.tokenize("chatml", messages=convo)
    ha, hb = a.block_hashes(16), b.block_hashes(16)
    shared = 0
    while shared < len(ha) and ha[shared] == hb[shared]:
        shared += 1
    common = next(
        (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
        len(a.token_ids),
    )
    assert shared == common // 16 > 0  # every full block of the common token prefix matches
    c = registry.tokenize("llama3", messages=convo)  # llama3 drops the generation prompt mid-history
    assert c.block_hashes(16)[:2] != hb[:2]


# --- layering --------------------------------------------------------------------------------------


def test_package_is_a_low_layer() -> None:
    package = Path(__file__).parent.parent / "extproc" / "tokenization"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith("transformers"), path
                assert not name.startswith("extproc") or name.startswith("extproc.tokenization"), (path, name)


def test_segmentation_disabled_when_probe_disagrees(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tokenizer whose pieces would not concatenate to the whole is encoded whole (still exact)."""
    from extproc.tokenization import backends

    real = backends._HFEncoder.encode

    def skewed(self: Any, pieces: Any, add_special_tokens: bool = False) -> list[array[int]]:
        return [
            array("I", [*ids, 7]) for ids in real(self, pieces, add_special_tokens)
        ]  # one extra id per piece

    monkeypatch.setattr(backends._HFEncoder, "encode", skewed)
    reg = from_config({"m": {"tokenizer_json": str(model_dir / "tokenizer.json")}})
    assert "encoding whole prompts" in caplog.text
    result = reg.tokenize("m", prompt="a<|im_start|>b<|im_end|>" * 20)
    assert result.segments == 1
