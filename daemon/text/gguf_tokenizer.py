"""A tokenizer built from a GGUF file's metadata, as llama.cpp builds it (llama-vocab.cpp).

`gpt2`: byte-level BPE with the file's merges, split by the regexes llama.cpp uses for the
file's `tokenizer.ggml.pre`. `llama`: SentencePiece BPE, merges ranked by the token scores,
byte fallback to <0xXX> tokens, a space prefix on each text run (add_space_prefix). `bert`:
WordPiece (llama.cpp's WPM): NFD, lowercase, split at whitespace and punctuation, longest
pieces first; the file marks a word's first piece with U+2581 instead of ## on the rest;
[CLS] text [SEP] around every input.

The tokenizer keys are read with the gguf package's reader over a memory map of the file
(daemon/model/gguf_file.py; about 0.5 s for a 49k-token vocabulary and its merges).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from cpud.model.gguf_file import field_value, open_gguf
from cpud.settings.errors import ConfigError, one_line

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss's o200k_harmony): tekken's letters with contractions, 1-3 digits
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> its regex splits, applied in order. "default" keeps GPT-2's
# regex, as transformers does (llama.cpp's own default is a legacy split it warns about).
PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "mellum"),
        (_GPT2,),
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
        (r"\p{N}", _GPT2),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "megrez"),
        (_QWEN2,),
    ),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "dbrx",
            "smaug-bpe",
        ),
        (_LLAMA3,),
    ),
    "tekken": (_TEKKEN,),
    "gpt-4o": (_GPT4O,),
}
# llama.cpp's LLAMA3 pre-tokenizer names: BOS added by default, and each whole pre-token looked
# up in the vocabulary before any merge (ignore_merges).
_LLAMA3_PRES = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
)
# llama.cpp's end-of-generation tokens found by their text (llama-vocab.cpp, special_eog_ids).
EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|return|>",
        "<|call|>",
    )
)
# o200k_harmony (gpt-oss): <|end|> closes a message, not the answer, where <|return|> and
# <|call|> exist (llama.cpp takes it out of the end-of-generation tokens then).
HARMONY_ENDS = ("<|return|>", "<|call|>")
MODELS = ("gpt2", "llama", "bert")
SPM_SPACE = "\u2581"
_KEY = "tokenizer.ggml."


def _byte_spelling() -> dict[int, str]:
    """GPT-2's printable character for each byte (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelled = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in spelled):
        spelled[b] = chr(256 + n)
    return spelled


_SPELLING = _byte_spelling()
_ALPHABET = frozenset(_SPELLING.values())


def _tokenizer_metadata(path: Path) -> dict[str, Any]:
    """The tokenizer keys (and general.architecture) of the file: those this process's read of
    the model found (cpud.model.gguf_model), else read with the gguf package's reader over its
    memory map."""
    from cpud.model.gguf_model import cached_gguf_model

    model = cached_gguf_model(path)
    if model is not None and model.tokenizer_keys:
        return model.tokenizer_keys
    reader = open_gguf(path)
    keys = [k for k in reader.fields if k.startswith("tokenizer.") or k == "general.architecture"]
    return {key: field_value(reader, key) for key in keys}


@dataclass
class GGUFVocab:
    """What the file says about its tokenizer, checked."""

    path: Path
    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str] | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: tuple[int, ...]
    chat_templates: dict[str, str] = field(default_factory=dict)
    sep_id: int | None = None  # WordPiece: the separator after every input


def read_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer metadata of a GGUF file; ConfigError (one line) when cpud cannot use it."""
    path = Path(path)
    try:
        return _read_vocab(path, _tokenizer_metadata(path))
    except (TypeError, ValueError, AttributeError, IndexError, KeyError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            f"{path}: tokenizer metadata of the wrong type or shape "
            f"({type(exc).__name__}: {one_line(str(exc), 120)}): convert the file again"
        ) from None


def _read_vocab(path: Path, meta: dict[str, Any]) -> GGUFVocab:

    def get(name: str, default: Any = None) -> Any:
        return meta.get(_KEY + name, default)

    model = get("model")
    if model is None:
        raise ConfigError(f"{path} has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in MODELS:
        raise ConfigError(
            f"{path}: tokenizer model {model!r} is not supported (tokenizer.ggml.model: "
            f"cpud reads {', '.join(MODELS)})"
        )
    pre = get("pre") or "default"
    if model == "gpt2" and pre not in PRE_SPLITS:
        raise ConfigError(
            f"{path}: pre-tokenizer {pre!r} is not supported (tokenizer.ggml.pre: cpud reads "
            f"{', '.join(sorted(PRE_SPLITS))})"
        )
    tokens = get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ConfigError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    n = len(tokens)
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise ConfigError(f"{path}: tokenizer.ggml.tokens holds {dup!r} twice")
    types = get("token_type") or [gguf.TokenType.NORMAL] * n
    scores = get("scores") or [0.0] * n
    if len(types) < n or len(scores) < n:
        raise ConfigError(f"{path}: tokenizer.ggml.token_type or .scores is shorter than the vocab")
    merges = get("merges")
    if model == "gpt2" and not merges:
        raise ConfigError(f"{path}: a gpt2 tokenizer needs tokenizer.ggml.merges")

    def token_id(name: str, default: int | None) -> int | None:
        value = get(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{_KEY}{name} is {value!r}, not a token id")
        return value if value is not None and 0 <= value < n else default

    spm, wpm = model == "llama", model == "bert"
    default_bos = 1 if spm and n > 1 else 101 if wpm and n > 101 else None
    vocab = GGUFVocab(
        path=path,
        model=model,
        pre=pre,
        tokens=tokens,
        types=list(types[:n]),
        scores=[float(s) for s in scores[:n]],
        merges=merges,
        bos_id=token_id("bos_token_id", default_bos),
        eos_id=token_id("eos_token_id", 2 if spm and n > 2 else None),
        unk_id=token_id("unknown_token_id", 0 if spm else 100 if wpm and n > 100 else None),
        pad_id=token_id("padding_token_id", None),
        add_bos=bool(get("add_bos_token", spm or pre in _LLAMA3_PRES)),
        add_eos=bool(get("add_eos_token", False)),
        add_space_prefix=bool(get("add_space_prefix", spm)),
        eog_ids=(),
        chat_templates=_chat_templates(meta),
        sep_id=token_id("seperator_token_id", 102 if n > 102 else None) if wpm else None,
    )
    if wpm:  # llama.cpp's WPM adds [CLS] and [SEP] whatever the add_* keys say
        if vocab.bos_id is None or vocab.sep_id is None or vocab.unk_id is None:
            raise ConfigError(
                f"{path}: a bert tokenizer needs tokenizer.ggml.bos_token_id ([CLS]), "
                f"seperator_token_id ([SEP]) and unknown_token_id"
            )
        vocab.add_bos, vocab.add_eos = True, False
    for flag, ident, name in (
        (vocab.add_bos, vocab.bos_id, "add_bos_token"),
        (vocab.add_eos, vocab.eos_id, "add_eos_token"),
    ):
        if flag and ident is None:
            raise ConfigError(f"{path}: tokenizer.ggml.{name} is true but the token id is not set")
    vocab.eog_ids = _eog_ids(vocab, token_id("eot_token_id", None), token_id("eom_token_id", None))
    return vocab


def _chat_templates(meta: dict[str, Any]) -> dict[str, str]:
    """tokenizer.chat_template, and the named ones (tokenizer.chat_template.NAME); for a file
    with none, its model family's template (Gemma 3 files carry none)."""
    out = {}
    if isinstance(default := meta.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE), str):
        out["default"] = default
    for name in meta.get(gguf.Keys.Tokenizer.CHAT_TEMPLATES) or ():
        template = meta.get(gguf.Keys.Tokenizer.CHAT_TEMPLATE_N.format(name=name))
        if isinstance(template, str):
            out[name] = template
    if not out and isinstance(arch := meta.get("general.architecture"), str):
        from cpud.ranks.models import registry

        family = registry.for_gguf(arch)
        if family is not None and family.chat_template is not None:
            out["default"] = family.chat_template
    return out


def _eog_ids(vocab: GGUFVocab, eot_id: int | None, eom_id: int | None) -> tuple[int, ...]:
    """Ids that end generation: eos first, then eot/eom and the tokens llama.cpp knows by text."""
    ids = [i for i in (vocab.eos_id, eot_id, eom_id) if i is not None]
    ids += [i for i, t in enumerate(vocab.tokens) if t in EOG_TEXTS]
    if all(t in vocab.tokens for t in HARMONY_ENDS):
        ids = [i for i in ids if vocab.tokens[i] != "<|end|>"]
    return tuple(dict.fromkeys(ids))


def _special_flags(vocab: GGUFVocab) -> list[bool | None]:
    """Per token: True special (control, unknown, end of generation), False user-defined, None
    part of the model's vocabulary."""
    flags: list[bool | None] = [None] * len(vocab.tokens)
    for i, kind in enumerate(vocab.types):
        if kind in (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN):
            flags[i] = True
        elif kind == gguf.TokenType.USER_DEFINED:
            flags[i] = False
    for i in vocab.eog_ids:
        flags[i] = True
    return flags


def _spelled(token: str) -> str:
    """A vocabulary entry in GPT-2's byte alphabet (some converters store raw text)."""
    if _ALPHABET.issuperset(token):
        return token
    return "".join(_SPELLING[b] for b in token.encode("utf-8"))


def _file_merges(merges: list[str] | None, ids: dict[str, int]) -> list[tuple[str, str]]:
    """The file's "left right" merges, split at the first space after the first character as
    llama.cpp splits them; merges of pieces the vocabulary lacks are dropped (they never apply)."""
    pairs = []
    for merge in merges or ():
        cut = merge.find(" ", 1)
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in ids and right in ids and left + right in ids:
            pairs.append((left, right))
    return pairs


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary, ranked as transformers' generate_merges
    ranks them: by the merged token's score, longer left piece first, then file order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    ranked = []
    seq = 0
    for token, score in score_of.items():
        local = [
            (token[:k], token[k:])
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        for left, right in local:
            ranked.append((-score, -len(left), -len(right), seq, left, right))
            seq += 1
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(vocab: GGUFVocab, tokens: list[str]) -> processors.PostProcessor | None:
    head = [vocab.bos_id] if vocab.add_bos and vocab.bos_id is not None else []
    tail = [vocab.eos_id] if vocab.add_eos and vocab.eos_id is not None else []
    tail += [vocab.sep_id] if vocab.sep_id is not None else []
    if not head and not tail:
        return None
    named = [(tokens[i], i) for i in dict.fromkeys(head + tail)]
    single = [f"{tokens[i]}:0" for i in head] + ["$A:0"] + [f"{tokens[i]}:0" for i in tail]
    pair = single + [f"{tokens[i]}:1" for i in head] + ["$B:1"] + [f"{tokens[i]}:1" for i in tail]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=named)


def _wordpiece_vocab(tokens: list[str], flags: list[bool | None]) -> dict[str, int]:
    """WordPiece's spelling of a WPM vocabulary: U+2581 word starts without it, continuations
    with ##, special tokens as they are (a spelling taken already keeps the file's)."""
    ids: dict[str, int] = {}
    for i, token in enumerate(tokens):
        name = token
        if flags[i] is None:
            name = token[1:] if token.startswith(SPM_SPACE) else "##" + token
        ids[name if name and name not in ids else token] = i
    return ids


def build_tokenizer(vocab: GGUFVocab) -> HFTokenizer:
    """The `tokenizers` object that encodes and decodes as llama.cpp does for this vocabulary."""
    try:
        return _build(vocab)
    except ConfigError:
        raise
    except Exception as exc:  # tokenizers raises bare Exceptions
        raise ConfigError(f"{vocab.path}: cannot build its tokenizer: {exc}") from None


def _build(vocab: GGUFVocab) -> HFTokenizer:
    flags = _special_flags(vocab)
    if vocab.model == "gpt2":
        tokens = [t if flags[i] is not None else _spelled(t) for i, t in enumerate(vocab.tokens)]
        ids = {t: i for i, t in enumerate(tokens)}
        model = models.BPE(
            ids, _file_merges(vocab.merges, ids), ignore_merges=vocab.pre in _LLAMA3_PRES
        )
        tok = HFTokenizer(model)
        splits = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_SPLITS[vocab.pre]
        ]
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
    elif vocab.model == "bert":
        tokens = vocab.tokens
        tok = HFTokenizer(
            models.WordPiece(
                _wordpiece_vocab(tokens, flags),
                unk_token=tokens[vocab.unk_id],
                max_input_chars_per_word=1 << 20,
            )
        )
        tok.normalizer = normalizers.Sequence(
            [
                normalizers.NFD(),
                normalizers.BertNormalizer(
                    clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=True
                ),
            ]
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
    else:
        tokens = vocab.tokens
        ids = {t: i for i, t in enumerate(tokens)}
        if vocab.merges:
            pairs = _file_merges(vocab.merges, ids)
        else:
            pairs = _spm_merges(tokens, vocab.scores)
        unk = tokens[vocab.unk_id] if vocab.unk_id is not None else None
        model = models.BPE(
            ids,
            pairs,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
        tok = HFTokenizer(model)
        steps = [normalizers.Replace(" ", SPM_SPACE)]
        tail = []
        if vocab.add_space_prefix:
            steps.insert(0, normalizers.Prepend(SPM_SPACE))
            tail = [decoders.Strip(" ", 1, 0)]
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence(
            [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
        )
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, f in enumerate(flags) if f]
    )
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, f in enumerate(flags)
            if f is False
        ]
    )
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ConfigError(f"{vocab.path}: tokenizer.ggml.tokens spell two tokens the same")
    post = _post_processor(vocab, tokens)
    if post is not None:
        tok.post_processor = post
    return tok
