"""Chat templates wherever models keep them, each through a real `cpud serve`: chat_template.jinja
beside tokenizer_config.json (current transformers; before, every chat request got 400 "no
chat_template"), a processor's chat_template.json, tokenizer_config.json's list of named
templates, and vLLM's --chat-template as a file and as inline text (here from
CPUD_CHAT_TEMPLATE). A template that cannot be read or parsed stops the daemon: exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from cpud.settings.errors import ConfigError
from cpud.text.chat_template import load_chat_template
from cpud.text.tokenizer import Tokenizer as CpudTokenizer
from cpud_server_helpers import launch, wait_healthy

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def template(tag: str) -> str:
    return "{% for m in messages %}[" + tag + " {{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def rendered(tag: str) -> str:
    return "".join(f"[{tag} {m['role']}] {m['content']}\n" for m in MESSAGES)


def model_copy(source: Path, target: Path, tokenizer_config: dict) -> Path:
    """The fixture model with its own tokenizer_config.json (weights linked, not copied)."""
    target.mkdir(parents=True)
    for path in source.iterdir():
        if path.name != "tokenizer_config.json":
            (target / path.name).symlink_to(path)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return target


@pytest.fixture(scope="module")
def variants(model_factory, tmp_path_factory):
    """variant -> (model dir, extra serve args, env, template tag the server must use)."""
    source = model_factory("qwen3")
    root = tmp_path_factory.mktemp("templates")
    config = json.loads((source / "tokenizer_config.json").read_text())
    bare = {k: v for k, v in config.items() if k != "chat_template"}

    jinja = model_copy(source, root / "jinja", bare)
    (jinja / "chat_template.jinja").write_text(template("jinja"))
    legacy = model_copy(source, root / "json", bare)
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": template("json")}))
    named = [
        {"name": "tool_use", "template": "tools: {{ tools | tojson }}\n" + template("list")},
        {"name": "default", "template": template("list")},
    ]
    listed = model_copy(source, root / "list", {**bare, "chat_template": named})
    base = model_copy(source, root / "base", bare)
    flag_file = root / "flag.jinja"
    flag_file.write_text(template("file"))
    inline = template("inline").replace("\n", "\\n")
    return {
        "jinja": (jinja, [], {}, "jinja"),
        "json": (legacy, [], {}, "json"),
        "list": (listed, [], {}, "list"),
        "flag-file": (jinja, ["--chat-template", str(flag_file)], {}, "file"),
        "env-inline": (base, [], {"CPUD_CHAT_TEMPLATE": inline}, "inline"),
    }


@pytest.fixture(scope="module")
def servers(variants, tmp_path_factory):
    logs = tmp_path_factory.mktemp("template-logs")
    extra = ("--max-model-len", "128", "--max-num-seqs", "4", "--weight-cache", "off")
    started = {
        name: launch(model, logs / f"{name}.log", *extra, *args, env=env)
        for name, (model, args, env, _) in variants.items()
    }
    try:
        yield {name: wait_healthy(server, timeout=180) for name, server in started.items()}
    finally:
        for server in started.values():
            server.stop()


@pytest.mark.parametrize("name", ["jinja", "json", "list", "flag-file", "env-inline"])
def test_chat_request_uses_the_template(variants, servers, name):
    model, _, _, tag = variants[name]
    base_url = servers[name].base_url
    chat = httpx.post(
        base_url + "/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 0
    tokens = httpx.post(base_url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    expected = Tokenizer.from_file(str(model / "tokenizer.json")).encode(
        rendered(tag), add_special_tokens=False
    )
    assert tokens["tokens"] == expected.ids


def test_named_templates_pick_tool_use_when_tools_are_given(servers):
    reply = httpx.post(
        servers["list"].base_url + "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 1,
            "chat_template_kwargs": {"tools": [{"type": "function", "name": "lookup"}]},
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    tokens = httpx.post(
        servers["list"].base_url + "/tokenize", json={"messages": MESSAGES}, timeout=60
    ).json()["count"]
    assert reply.json()["usage"]["prompt_tokens"] > tokens


@pytest.mark.parametrize(
    "value, message",
    [
        ("{% for m in messages %}{{ m.content }", "--chat-template: chat template does not parse"),
        ("/nonexistent/template.jinja", "--chat-template '/nonexistent/template.jinja' looks"),
    ],
    ids=["syntax", "missing-file"],
)
def test_bad_chat_template_stops_serve_with_exit_2(model_factory, value, message):
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--model", str(model_factory("qwen3"))]
    done = subprocess.run(
        [*cmd, "--chat-template", value], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("cpud: error:")]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_sources_take_precedence_as_in_transformers(model_factory, tmp_path):
    source = model_factory("qwen3")
    config = json.loads((source / "tokenizer_config.json").read_text())
    both = model_copy(source, tmp_path / "both", {**config, "chat_template": template("config")})
    (both / "chat_template.json").write_text(json.dumps({"chat_template": template("json")}))
    assert CpudTokenizer(both).apply_chat_template(MESSAGES, False) == rendered("config")
    (both / "chat_template.jinja").write_text(template("jinja"))
    (both / "additional_chat_templates").mkdir()
    (both / "additional_chat_templates" / "tool_use.jinja").write_text(template("tools"))
    tok = CpudTokenizer(both)
    assert tok.apply_chat_template(MESSAGES, False) == rendered("jinja")
    assert tok.apply_chat_template(MESSAGES, False, tools=[]) == rendered("tools")
    override = CpudTokenizer(both, chat_template=template("flag").replace("\n", "\\n"))
    assert override.apply_chat_template(MESSAGES, False, tools=[]) == rendered("flag")


def test_a_malformed_template_entry_is_a_config_error(model_factory, tmp_path):
    source = model_factory("qwen3")
    config = json.loads((source / "tokenizer_config.json").read_text())
    bad = model_copy(source, tmp_path / "bad", {**config, "chat_template": [{"name": 1}]})
    with pytest.raises(ConfigError, match="tokenizer_config.json: chat_template is neither"):
        CpudTokenizer(bad)


def test_inline_templates_decode_escapes_and_keep_unicode(tmp_path):
    assert load_chat_template("¡hola! 日本 {{ x }}\\n\\t") == "¡hola! 日本 {{ x }}\n\t"
    path = tmp_path / "t.jinja"
    path.write_text("{{ x }}\\n")
    assert load_chat_template(str(path)) == "{{ x }}\\n"


def test_offline_llm_takes_chat_template(model_factory):
    from cpud import LLM, SamplingParams

    model = model_factory("qwen3")
    with LLM(model, dtype="float32", chat_template=template("llm"), max_model_len=128) as llm:
        [output] = llm.chat(MESSAGES, SamplingParams(max_tokens=1))
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    expected = tok.encode(rendered("llm"), add_special_tokens=False)
    assert output.prompt_token_ids == expected.ids
