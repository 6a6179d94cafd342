"""Chat templates render under a budget of CPU time and characters that template code cannot
escape: loops, recursion, string and list arithmetic, format widths, padding, joins and shared
references all stop with a 400 naming the template, quickly and without building the data; a
template that cannot render a sample conversation in its budget is refused before start-up;
real templates render as before and well within the budget."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cpud.fixtures.templates import chat_template
from cpud.settings.errors import ConfigError, RequestError
from cpud.text.chat_template import ChatTemplates, _tojson
from cpud.text.template_budget import RenderBudget

FAST = RenderBudget(seconds=0.2)
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HOSTILE = {
    "nested ranges": NESTED_RANGES,
    "string times number": "{{ 'a'*10**8 * 100 }}",
    "huge power": "{{ 10**(10**8) }}",
    "doubling by +": "{% set ns = namespace(s='a'*100000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling by ~": "{% set ns = namespace(s='a'*100000) %}{% for i in range(40) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "center filter": "{{ 'a'|center(10**9) }}",
    "ljust method": "{{ 'a'.ljust(10**9) }}",
    "format width": "{{ '{:>1000000000}'.format('a') }}",
    "nested format width": "{{ '{:>{}}'.format('a', 10**9) }}",
    "percent width": "{{ '%1000000000s' % 'a' }}",
    "percent star": "{{ '%*s' % (1000000000, 'a') }}",
    "format filter": "{{ '%1000000000d'|format(1) }}",
    "replace method": "{{ ('a'*1000000).replace('a', 'b'*1000) }}",
    "replace filter": "{{ ('a'*1000000)|replace('a', 'b'*1000) }}",
    "indent": "{{ ('\\n'*1000000)|indent(1000) }}",
    "join method": "{{ ('b'*1000).join(['a']*1000000) }}",
    "list of shared strings": "{{ ['a'*1000]*1000000 }}",
    "doubling shared lists": "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(60) %}"
    "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
    "sum of lists": "{{ ([[1]*1000]*1000)|sum(start=[]) }}",
    "expandtabs": "{{ ('\\t'*1000000).expandtabs(10000) }}",
    "striptags": "{{ ('<>'*500000)|striptags }}",
    "tojson indent": "{{ (range(100000)|list)|tojson(indent=100000) }}",
    "to_bytes": "{{ 1 .to_bytes(10**9, 'big') }}",
    "exponential macro": "{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}"
    "{% endmacro %}{{ f(60) }}",
    "recursive loop": "{% for i in range(100000) recursive %}{% if loop.depth < 3 %}"
    "{{ loop(range(100000)) }}{% endif %}{% endfor %}",
    "set block of text": "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}{% endset %}{{ x|length }}",
    "output of text": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
    "fromkeys compared": "{{ {}.fromkeys(range(100000), 'a'*100000) == "
    "{}.fromkeys(range(100000), 'a'*100000) }}",
    "loops over strings": "{% for i in ('a'*1000000) %}{% for j in ('a'*1000000) %}{% endfor %}"
    "{% endfor %}",
    "growing list": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
    "{% set ns.l = ns.l + ['a'*1000 ~ i] %}{% endfor %}",
}


def templates(text: str, budget: RenderBudget = FAST) -> ChatTemplates:
    return ChatTemplates({"default": text}, "--chat-template", budget=budget)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_stops_quickly_with_a_clear_400(name):
    chat = templates(HOSTILE[name])
    tracemalloc.start()
    started = time.thread_time()
    try:
        with pytest.raises(RequestError) as caught:
            chat.render(MESSAGES, True, {}, {})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    spent = time.thread_time() - started
    assert caught.value.code == "chat_template_budget"
    assert caught.value.param == "messages"
    assert "chat template (--chat-template) went past its render budget" in str(caught.value)
    assert spent < 3.0  # 0.2 s of budget, under tracemalloc on a busy machine
    assert peak < 64 << 20


def test_deep_recursion_is_a_plain_400():
    chat = templates("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}")
    with pytest.raises(RequestError, match="RecursionError"):
        chat.render(MESSAGES, True, {}, {})


CONVERSATION = [{"role": "system", "content": "s" * 1000}] + [
    {"role": role, "content": f"{role} turn {i} " + "x" * 2000}
    for i in range(200)
    for role in ("user", "assistant")
]


@pytest.mark.parametrize("name", ["chatml.jinja", "llama3.jinja", "mistral.jinja", "opt.jinja"])
def test_real_templates_render_as_plain_jinja_within_budget(name):
    text = chat_template(name)
    messages = CONVERSATION if name != "mistral.jinja" else CONVERSATION[1:]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    plain.filters["tojson"] = _tojson
    expected = plain.from_string(text).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    # a 16th of the default budget still renders a 800 kB, 400-message conversation
    tight = RenderBudget(seconds=1.0, chars=1 << 16, per_input_char=4)
    assert templates(text, tight).render(messages, True, specials, {}) == expected


def test_templates_with_tools_macros_and_formats_render_unchanged():
    text = (
        "{% macro show(t) %}{{ t.name }}({{ t.parameters|tojson(indent=2) }}){% endmacro %}"
        "{% set ns = namespace(last=-1) %}{% for m in messages[::-1] %}"
        "{% if ns.last < 0 and m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
        "{% endfor %}{% for t in tools or [] %}{{ show(t) }}\n{% endfor %}"
        "{% for m in messages %}{{ '<%s>'|format(m.role) ~ m.content.split('</think>')[-1] }}"
        "{{ '{:>8}'.format(loop.index) }}{% endfor %}{{ ns.last }}"
    )
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"b": [1]}}}}]
    plain = ImmutableSandboxedEnvironment()
    plain.filters["tojson"] = _tojson
    expected = plain.from_string(text).render(messages=MESSAGES, tools=tools)
    assert templates(text).render(MESSAGES, False, {}, {"tools": tools}) == expected


def test_a_template_that_blows_up_on_long_content_passes_the_probe_not_the_request():
    text = (
        "{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}"
        "{% endfor %}{{ m.content }}{% endfor %}"
    )
    chat = templates(text)
    chat.probe({})
    assert chat.render(MESSAGES, True, {}, {}) == "hiyo"
    long = [{"role": "user", "content": "x" * 20000}]
    with pytest.raises(RequestError, match="CPU") as caught:
        chat.render(long, True, {}, {})
    assert caught.value.code == "chat_template_budget"


@pytest.mark.parametrize("name", ["nested ranges", "string times number"])
def test_the_probe_refuses_a_template_naming_it_and_the_budget(name):
    chat = ChatTemplates(
        {"default": HOSTILE[name]}, "x", source="tokenizer.chat_template of m", budget=FAST
    )
    with pytest.raises(ConfigError) as caught:
        chat.probe({})
    message = str(caught.value)
    assert message.startswith("tokenizer.chat_template of m cannot render a")
    assert "within its budget (0.2 s of CPU plus 1 ms per message" in message


def test_the_probe_leaves_ordinary_template_errors_to_the_requests():
    refuses_system = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    templates(refuses_system).probe({})
    templates("{{ messages[5].content.upper() }}").probe({})
