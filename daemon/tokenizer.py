"""The model's tokenizer (tokenizer.json), its special tokens and its chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from cpud.errors import ConfigError, RequestError
from cpud.ranks.model_config import read_json_object


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


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
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
        self.chat_template: str | None = tok_cfg.get("chat_template")
        self.bos_token = _token_text(tok_cfg.get("bos_token"))
        self.eos_token = _token_text(tok_cfg.get("eos_token"))
        eos_ids = _ids(gen_cfg.get("eos_token_id"))
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos_ids.insert(0, self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise_template_error

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def max_token_bytes(self) -> int:
        """An upper bound on the bytes one token decodes to: the longest vocabulary entry in
        UTF-8 (byte-level and SentencePiece spellings are never shorter than their bytes)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(piece.encode()) for piece in vocab), default=1)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        if not self.chat_template:
            raise RequestError(
                "this model has no chat_template in tokenizer_config.json: use completions",
                param="messages",
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,  # chat_template_kwargs override the special tokens, as in transformers
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._env.from_string(self.chat_template).render(context)
        except Exception as exc:  # the template runs on request data: any failure is a 400
            detail = exc if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise RequestError(f"chat template failed: {detail}", param="messages") from None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)
