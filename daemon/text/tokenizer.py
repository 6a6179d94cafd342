"""The model's tokenizer, its special tokens and its chat templates: from a Hugging Face
directory (tokenizer.json) or from a GGUF file's metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from cpud.model.model_config import read_json_object
from cpud.protocol.launch import TokenizerFacts
from cpud.settings.errors import ConfigError
from cpud.text.chat_template import ChatTemplates, hf_chat_templates, load_chat_template


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, finite=False) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def gguf_file(path: Path) -> Path | None:
    """The GGUF file `path` names: a file itself, or the only .gguf of a directory that has no
    tokenizer.json."""
    if path.is_file() or (path.suffix == ".gguf" and not path.exists()):
        return path
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


def chat_template_override(value: str) -> ChatTemplates:
    """--chat-template (a file or the template itself), loaded and parsed: ConfigError if not."""
    return ChatTemplates({"default": load_chat_template(value)}, "--chat-template", strict=True)


def check_tokenizer(model: Path, chat_template: str | None = None) -> None:
    """ConfigError (one line) for what Tokenizer(model, chat_template) would refuse, found
    before any rank starts: a GGUF tokenizer cpud cannot build (about 0.6 s for 49k tokens),
    a model's chat template file that cannot be read, a --chat-template that cannot be read or
    does not parse, a chat template that cannot render a sample conversation within its
    render budget."""
    found = gguf_file(model)
    if found is not None:
        from cpud.text.gguf_tokenizer import build_tokenizer, read_vocab

        vocab = read_vocab(found)
        build_tokenizer(vocab)  # ConfigError when cpud cannot build it
        specials = _gguf_specials(vocab)
        source = f"tokenizer.chat_template of {found.name}"
        templates = ChatTemplates(vocab.chat_templates, source, source=source)
    else:
        tok_cfg = _read_json(model / "tokenizer_config.json")
        specials = {name: _token_text(tok_cfg.get(name)) for name in ("bos_token", "eos_token")}
        if chat_template is None:
            source = f"the chat template of {model}"
            templates = ChatTemplates(hf_chat_templates(model, tok_cfg), source, source=source)
    if chat_template is not None:
        templates = chat_template_override(chat_template)
    templates.probe(specials)


def _gguf_specials(vocab: Any) -> dict[str, str | None]:
    def text(token_id: int | None) -> str | None:
        return None if token_id is None else vocab.tokens[token_id]

    return {
        "bos_token": text(vocab.bos_id),
        "eos_token": text(vocab.eos_id),
        "unk_token": text(vocab.unk_id),
        "pad_token": text(vocab.pad_id),
    }


class Tokenizer:
    """path: a model directory or a .gguf file. chat_template: --chat-template, which replaces
    the model's templates."""

    def __init__(self, path: str | Path, chat_template: str | None = None):
        path = Path(path)
        self.eos_token_ids: tuple[int, ...] = ()
        self.bos_token: str | None = None
        self.eos_token: str | None = None
        self.specials: dict[str, str | None] = {}
        found = gguf_file(path)
        if found is not None:
            self._from_gguf(found)
        else:
            self._from_hf(path)
        if chat_template is not None:
            self.chat_templates = chat_template_override(chat_template)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def facts(self) -> TokenizerFacts:
        """This tokenizer as from_facts rebuilds it in another process."""
        return TokenizerFacts(
            json=self._tok.to_str(),
            specials=dict(self.specials),
            eos_token_ids=list(self.eos_token_ids),
            chat_templates=dict(self.chat_templates.templates),
            template_origin=self.chat_templates.origin,
            template_source=self.chat_templates.source,
        )

    @classmethod
    def from_facts(cls, facts: TokenizerFacts) -> Tokenizer:
        """The tokenizer `facts()` described, rebuilt without reading the model's files."""
        self = cls.__new__(cls)
        self._tok = HFTokenizer.from_str(facts.json)
        self.chat_templates = ChatTemplates(
            facts.chat_templates, facts.template_origin, source=facts.template_source
        )
        self.specials = dict(facts.specials)
        self.bos_token = self.specials.get("bos_token")
        self.eos_token = self.specials.get("eos_token")
        self.eos_token_ids = tuple(facts.eos_token_ids)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        return self

    def _from_hf(self, model_dir: Path) -> None:
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"{path} is missing: cpud reads fast tokenizers (tokenizer.json) only"
            )
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise ConfigError(f"{path} cannot be loaded: {str(exc).splitlines()[0]}") from None
        tok_cfg = _read_json(model_dir / "tokenizer_config.json")
        gen_cfg = _read_json(model_dir / "generation_config.json")
        self.chat_templates = ChatTemplates(
            hf_chat_templates(model_dir, tok_cfg),
            "none in chat_template.jinja, tokenizer_config.json or chat_template.json",
            source=f"the chat template of {model_dir}",
        )
        self.specials = {
            name: _token_text(tok_cfg.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        self.bos_token = self.specials["bos_token"]
        self.eos_token = self.specials["eos_token"]
        eos_ids = _ids(gen_cfg.get("eos_token_id"))
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos_ids.insert(0, self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = tuple(dict.fromkeys(eos_ids))

    def _from_gguf(self, path: Path) -> None:
        from cpud.text.gguf_tokenizer import build_tokenizer, read_vocab

        vocab = read_vocab(path)
        self._tok = build_tokenizer(vocab)
        self.chat_templates = ChatTemplates(
            vocab.chat_templates,
            f"no tokenizer.chat_template in {path.name}",
            source=f"tokenizer.chat_template of {path.name}",
        )
        self.specials = _gguf_specials(vocab)
        self.bos_token = self.specials["bos_token"]
        self.eos_token = self.specials["eos_token"]
        self.eos_token_ids = vocab.eog_ids

    @property
    def chat_template(self) -> str | None:
        """The template used when a request passes no tools."""
        return self.chat_templates.default

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` serializes it (tokenizer.json), for grammar engines."""
        return self._tok.to_str()

    def max_token_bytes(self) -> int:
        """An upper bound on the bytes one token decodes to: the longest vocabulary entry in
        UTF-8 (byte-level and SentencePiece spellings are never shorter than their bytes)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(piece.encode()) for piece in vocab), default=1)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The conversation rendered as transformers renders it; `extra` (tools,
        chat_template_kwargs) reaches the template and overrides the special tokens."""
        return self.chat_templates.render(messages, add_generation_prompt, self.specials, extra)
