"""Chat templates: where models keep them, vLLM's --chat-template, and rendering as transformers
renders them (sandboxed jinja, trim_blocks/lstrip_blocks, tojson without HTML escaping,
raise_exception, strftime_now, the special tokens and tools in the context), each render under
a budget of CPU time and characters (cpud.text.template_budget)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import TemplateError

from cpud.process.user_files import MAX_SIDE_FILE_BYTES, MAX_TEMPLATE_BYTES, read_text
from cpud.settings.errors import ConfigError, RequestError, one_line
from cpud.text.template_budget import BudgetedEnvironment, RenderBudget, TemplateBudgetError

log = logging.getLogger(__name__)
DEFAULT_BUDGET = RenderBudget()
JINJA_CHARS = "{}\n"
# What a template must render within its budget before the daemon starts with it.
PROBES = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": "I am an assistant. How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Hello!"}],
)


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: the text of the file it names, else the value itself as a
    template (backslash escapes such as \\n decoded)."""
    try:
        return read_text(Path(value).expanduser(), MAX_TEMPLATE_BYTES, "--chat-template ")
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        if not any(c in value for c in JINJA_CHARS):
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise ConfigError(
                f"--chat-template {value!r} looks like a file path but cannot be read: {reason}"
            ) from None
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--chat-template: bad escape in the inline template: {exc}") from None


def _named(value: Any, source: Path) -> dict[str, str]:
    """A chat_template value as transformers stores it: a string, or [{name, template}, ...]."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, Mapping)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(
        f"{source}: chat_template is neither a string nor a list of {{name, template}}"
    )


def _read_text(path: Path) -> str:
    try:
        return read_text(path, MAX_SIDE_FILE_BYTES)
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None


def hf_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """The templates of a Hugging Face directory, by name, as transformers reads them:
    chat_template.jinja and additional_chat_templates/*.jinja first, else tokenizer_config.json's
    chat_template, else a processor's chat_template.json."""
    files = {}
    main = model_dir / "chat_template.jinja"
    if main.is_file():
        files["default"] = main
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        files.update({p.stem: p for p in sorted(extra.glob("*.jinja"))})
    if files:
        return {name: _read_text(p) for name, p in files.items()}
    if tokenizer_config.get("chat_template") is not None:
        return _named(tokenizer_config["chat_template"], model_dir / "tokenizer_config.json")
    legacy = model_dir / "chat_template.json"
    if legacy.is_file():
        try:
            data = json.loads(_read_text(legacy))
        except ValueError as exc:
            raise ConfigError(f"{legacy} is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{legacy} is not a JSON object")
        return _named(data.get("chat_template"), legacy)
    return {}


class _Generation(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}: renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> BudgetedEnvironment:
    env = BudgetedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.meter_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _context(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    specials: Mapping[str, str | None],
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """What a template sees, as transformers passes it."""
    return {
        "bos_token": "",
        "eos_token": "",
        "tools": None,
        "documents": None,
        **{k: v for k, v in specials.items() if v is not None},
        **extra,  # chat_template_kwargs override the special tokens, as in transformers
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }


def known_roles(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """OpenAI's `developer` role is `system` to a template that never names it."""
    if "developer" in template or all(m.get("role") != "developer" for m in messages):
        return messages
    return [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]


class ChatTemplates:
    """A model's chat templates by name ("default", "tool_use", ...), compiled once each.

    strict: a template that does not parse is a ConfigError now (--chat-template); otherwise the
    chat requests that need it fail with a 400. source: where the templates come from, as
    messages name it. Each render runs under `budget`: past it, the request gets a 400 that
    names the template (probe() refuses such a template before the daemon starts)."""

    def __init__(
        self,
        templates: Mapping[str, str],
        origin: str,
        strict: bool = False,
        source: str | None = None,
        budget: RenderBudget = DEFAULT_BUDGET,
    ):
        self.templates = dict(templates)
        self.origin = origin
        if source is None:
            source = origin if origin == "--chat-template" else "the model's chat template"
        self.source = source
        self.budget = budget
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}
        if strict:
            for name in self.templates:
                try:
                    self._compile(name)
                except TemplateError as exc:
                    raise ConfigError(
                        f"{origin}: chat template does not parse: {one_line(str(exc))}"
                    ) from None

    @property
    def default(self) -> str | None:
        """The template used without tools (transformers' tokenizer.chat_template as a string)."""
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        return self.templates.get("default")

    def tool_template(self) -> str | None:
        """The template a request with tools renders through ("tool_use" when there is one),
        None when there is none to pick."""
        try:
            return self.templates[self._pick(tools=[])] if self.templates else None
        except RequestError:
            return None

    def _compile(self, name: str) -> jinja2.Template:
        if name not in self._compiled:
            self._compiled[name] = self._env.from_string(self.templates[name])
        return self._compiled[name]

    def _pick(self, tools: Any) -> str:
        if len(self.templates) == 1:
            return next(iter(self.templates))
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise RequestError(
            f"this model has several chat templates ({', '.join(sorted(self.templates))}) and "
            "none is the default: pass one with --chat-template",
            param="messages",
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        specials: Mapping[str, str | None],
        extra: Mapping[str, Any],
    ) -> str:
        if not self.templates:
            raise RequestError(
                f"this model has no chat_template ({self.origin}): use completions, or "
                "start cpud with --chat-template",
                param="messages",
            )
        context = _context(messages, add_generation_prompt, specials, extra)
        name = self._pick(context["tools"])
        context["messages"] = known_roles(messages, self.templates[name])
        try:
            return self._env.render(lambda: self._compile(name), context, self.budget)
        except TemplateBudgetError as exc:
            raise self._over_budget(name, exc) from None
        except RequestError:
            raise
        except Exception as exc:  # the template runs on request data: any failure is a 400
            detail = exc if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise RequestError(
                f"chat template failed: {one_line(str(detail))}", param="messages"
            ) from None

    def _label(self, name: str) -> str:
        return self.source if len(self.templates) == 1 else f"{self.source} {name!r}"

    def _over_budget(self, name: str, exc: TemplateBudgetError) -> RequestError:
        """A 400, not a 500: the start-up probe refused templates that fail any conversation,
        so this one fails on what this conversation holds; the client can shorten it, and
        resending it as is (as clients retry 5xx answers) would only spend the budget again.
        The template is as much at fault, so the operator hears of it in the log."""
        label = self._label(name)
        log.warning("chat template %s went past its render budget: %s", label, exc)
        return RequestError(
            f"the chat template ({label}) went past its render budget on this conversation: "
            f"{exc}; shorten the conversation, or ask the server's operator to fix the template",
            param="messages",
            code="chat_template_budget",
        )

    def probe(self, specials: Mapping[str, str | None]) -> None:
        """ConfigError unless every template renders short sample conversations within its
        budget; other failures (a template that refuses a system message) are left to the
        requests, which get a 400."""
        for name in self.templates:
            for messages in PROBES:
                context = _context(messages, True, specials, {})
                try:
                    self._env.render(lambda n=name: self._compile(n), context, self.budget)
                except TemplateBudgetError as exc:
                    raise ConfigError(
                        f"{self._label(name)} cannot render a {len(messages)}-message sample "
                        f"conversation within its budget ({self.budget.describe()}): {exc}; "
                        "fix the template or pass another with --chat-template"
                    ) from None
                except Exception:  # noqa: S112 - the requests that hit it get a 400
                    continue
