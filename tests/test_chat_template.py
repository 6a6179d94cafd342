"""Chat template rendering with request-supplied chat_template_kwargs."""

from __future__ import annotations

import json
import shutil

import pytest

from cpud.settings.errors import RequestError
from cpud.text.tokenizer import Tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% for tool in tools or [] %}(tool {{ tool }}){% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(model_factory, tmp_path_factory):
    source = model_factory("qwen3")
    target = tmp_path_factory.mktemp("template")
    shutil.copy(source / "tokenizer.json", target)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.update(chat_template=TEMPLATE, bos_token="<s>")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(target)


def test_kwargs_reach_the_template_and_override_the_special_tokens(tokenizer):
    assert tokenizer.apply_chat_template(MESSAGES) == "<s>[user] hi\n[assistant]"
    assert (
        tokenizer.apply_chat_template(MESSAGES, False, tools=["a", "b"], bos_token="")
        == "[user] hi\n(tool a)(tool b)"
    )


def test_a_template_failing_on_request_data_is_a_request_error(tokenizer):
    with pytest.raises(RequestError, match="chat template failed: TypeError") as info:
        tokenizer.apply_chat_template(MESSAGES, tools=5)  # not iterable
    assert info.value.param == "messages"
