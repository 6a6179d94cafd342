"""A fixture model's tokenizer written into GGUF metadata the way llama.cpp's convert_hf_to_gguf.py
writes it: kind "gpt2" is the byte-level BPE of tokenizer.json (get_vocab_base + _set_vocab_gpt2),
kind "llama" a SentencePiece-style BPE with scores and <0xXX> byte fallback tokens
(_set_vocab_sentencepiece), trained here on the fixture corpus since fixtures ship no
tokenizer.model."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
from tokenizers import Tokenizer

from cpud.fixtures.tokenizer import corpus_lines

SPM_SPACE = "\u2581"


def _hparams(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _default_pre(model_dir: Path) -> str:
    """What convert_hf_to_gguf's get_vocab_base_pre finds for the fixture families' split regex."""
    pre = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]
    return "qwen2" if pre.get("type") == "Sequence" else "gpt-2"


def gpt2_vocab(model_dir: Path) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf's get_vocab_base: tokens and token types, padded to config vocab_size."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = _hparams(model_dir).get("vocab_size", len(vocab))
    assert max(vocab.values()) < vocab_size
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_tokens_decoder()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if added[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace(SPM_SPACE, " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _tokenizer_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))


def spm_vocab(model_dir: Path) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary as llama.cpp stores one: <unk> <s> </s>, 256 byte tokens
    <0x00>..<0xFF>, then pieces with "\u2581" for spaces scored by training order (earlier
    higher, as sentencepiece scores them), then the fixture family's other special tokens as
    CONTROL, padded to vocab_size. The alphabet is capped so rarer characters (uppercase among
    them) take the byte fallback."""
    from tokenizers import SentencePieceBPETokenizer

    decoder = _tokenizer_config(model_dir)["added_tokens_decoder"]
    specials = [v["content"] for _, v in sorted(decoder.items(), key=lambda kv: int(kv[0]))]
    head = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab_size = _hparams(model_dir)["vocab_size"]
    extra = [t for t in specials if t not in head]
    learned_budget = vocab_size - len(head) - len(byte_tokens) - len(extra)
    spm = SentencePieceBPETokenizer(replacement=SPM_SPACE, add_prefix_space=True)
    spm.train_from_iterator(
        corpus_lines(),
        vocab_size=learned_budget,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        limit_alphabet=80,
    )
    model = json.loads(spm.to_str())["model"]
    pieces = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = head + byte_tokens
    scores = [0.0] * len(tokens)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * len(byte_tokens)
    for rank, (piece, _) in enumerate(pieces):
        tokens.append(piece)
        scores.append(-float(rank))
        types.append(gguf.TokenType.NORMAL)
    for t in extra:
        tokens.append(t)
        scores.append(0.0)
        types.append(gguf.TokenType.CONTROL)
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    return tokens, scores, types


def add_tokenizer_metadata(
    writer: gguf.GGUFWriter, model_dir: Path, kind: str = "gpt2", *, pre: str | None = None
) -> None:
    """Write model_dir's tokenizer into writer's metadata as convert_hf_to_gguf.py does.

    kind "gpt2": token count equals config.json vocab_size, ids equal tokenizer.json's.
    kind "llama": a new SentencePiece vocabulary of the same size holding the family's special
    tokens as CONTROL, bos/eos as tokenizer_config.json names them (else <s>, </s>), and the
    family's chat template. kind "bert": tokenizer.json's WordPiece vocabulary with BertModel's
    phantom spaces (llama.cpp's WPM)."""
    model_dir = Path(model_dir)
    if kind == "gpt2":
        tokens, types = gpt2_vocab(model_dir)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or _default_pre(model_dir))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(
            writer, quiet=True
        )
    elif kind == "llama":
        tokens, scores, types = spm_vocab(model_dir)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre(pre or "default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        cfg = _tokenizer_config(model_dir)
        writer.add_bos_token_id(tokens.index(cfg.get("bos_token") or "<s>"))
        writer.add_eos_token_id(tokens.index(cfg.get("eos_token") or "</s>"))
        writer.add_unk_token_id(tokens.index("<unk>"))
        writer.add_pad_token_id(tokens.index("<unk>"))
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        template = gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).chat_template
        if template is not None:
            writer.add_chat_template(template)
    elif kind == "bert":
        tokens, types = gpt2_vocab(model_dir)
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre(pre or "default")
        writer.add_token_list([_phantom(t, k) for t, k in zip(tokens, types)])
        writer.add_token_types(types)
        gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}: gpt2, llama or bert")


def _phantom(token: str, kind: int) -> str:
    """BertModel.set_vocab's phantom space: a word's first piece gets U+2581, a ## continuation
    loses its ##; control tokens stay as they are."""
    if kind == gguf.TokenType.CONTROL:
        return token
    return token[2:] if token.startswith("##") else SPM_SPACE + token
