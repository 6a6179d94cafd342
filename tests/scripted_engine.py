"""The HTTP app over a real engine whose executor writes scripted tokens instead of running a
model: what a reasoning model answers (think blocks, harmony channels) goes through the real
detokenizer, scheduler and API code. The tokenizer is the qwen3 fixture's with gpt-oss's
harmony markers added as special tokens and `<think>`, `</think>` as plain added tokens (as
Qwen3's are), in ids the fixture's padded vocabulary leaves free."""

from __future__ import annotations

import json
import shutil
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from stub_engine import TokenWriter
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from cpud.engine.llm_engine import LLMEngine
from cpud.frontend.app import create_app
from cpud.frontend.async_engine import AsyncEngine
from cpud.frontend.state import ServerConfig, ServerState
from cpud.protocol.step import SampledToken, SeqWork
from cpud.settings.config import EngineArgs, resolve_config
from cpud.text.tokenizer import Tokenizer

HARMONY_SPECIALS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
ENDS = ("<|return|>", "<|call|>", "<|im_end|>")

THINK_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}"
)
# Opens the think block in the prompt, as Qwen3-Thinking and DeepSeek-R1 templates do.
OPEN_THINK_TEMPLATE = THINK_TEMPLATE.replace(
    "{%- if enable_thinking", "<think>\n{%- if enable_thinking"
)
HARMONY_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}"
    "{%- if m.role == 'assistant' %}<|channel|>final{%- endif %}<|message|>{{ m.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def reasoning_model(source: Path, folder: Path) -> Path:
    """A copy of the fixture model at `source` whose tokenizer knows the reasoning markers."""
    shutil.copytree(source, folder)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.save(str(folder / "tokenizer.json"))
    ends = [tok.token_to_id(t) for t in ENDS]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    return folder


class ScriptedExecutor(TokenWriter):
    """Each new sequence writes the next script's tokens, then an end token."""

    def __init__(self, end_token: int):
        self.end_token = end_token
        self.scripts: deque[list[int]] = deque()
        self.writing: dict[int, deque[int]] = {}

    def write(self, work: SeqWork) -> SampledToken:
        if work.seq_id not in self.writing:
            self.writing[work.seq_id] = deque(self.scripts.popleft())
        script = self.writing[work.seq_id]
        return SampledToken(work.seq_id, script.popleft() if script else self.end_token)


class ScriptedServer:
    def __init__(self, model: Path, template: str, reasoning_parser: str | None = None):
        self.tokenizer = Tokenizer(model, template)
        config = resolve_config(EngineArgs(model=model, dtype="float32", max_model_len=512), model)
        self.executor = ScriptedExecutor(self.tokenizer.eos_token_ids[0])
        self.state = ServerState(
            ServerConfig(("scripted",), config.max_model_len, reasoning_parser=reasoning_parser),
            self.tokenizer,
        )
        self.engine = AsyncEngine(LLMEngine(config, self.tokenizer, self.executor))
        self.state.attach(self.engine)
        self.app = create_app(self.state)

    def will_say(self, *texts: str) -> None:
        """The next requests' outputs (one text per sequence, in the order they start)."""
        for text in texts:
            self.executor.scripts.append(self.tokenizer.encode(text, add_special_tokens=False))

    def close(self) -> None:
        self.engine.shutdown()
        self.state.close()


@contextmanager
def scripted_clients(model: Path, template: str, reasoning_parser: str | None = None):
    """(server, openai client, raw http client) over the app in this process."""
    from openai import OpenAI
    from starlette.testclient import TestClient

    server = ScriptedServer(model, template, reasoning_parser)
    try:
        with TestClient(server.app) as http:
            client = OpenAI(
                base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
            )
            yield server, client, http
    finally:
        server.close()
