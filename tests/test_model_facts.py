"""What the supervisor hands its children instead of the model's files: the config and a GGUF
file's tensor table (ModelFacts, in the engine spec) and the built tokenizer (TokenizerFacts, in
the frontend's spec). What a child rebuilds from them equals what it would have read itself."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from cpud.model import gguf_model
from cpud.model.gguf_facts import adopt_gguf_facts
from cpud.model.load import config_from_facts, load_model_config, model_facts
from cpud.protocol.launch import ModelFacts, TokenizerFacts
from cpud.text.tokenizer import Tokenizer

TEXTS = ["Hello world, the capital of France is", " spaced  out\n\ttabs", "naïve café 東京 🚀"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def over_the_wire(value, kind):
    return msgspec.json.decode(msgspec.json.encode(value), type=kind)


@pytest.fixture
def fresh_process(monkeypatch):
    """An empty per-process GGUF cache, as in a child that has read nothing yet."""
    monkeypatch.setattr(gguf_model, "_CACHE", {})


@pytest.mark.parametrize("qtype", [T.Q8_0, T.F32, T.Q4_K])
def test_a_rank_maps_the_tensors_the_reader_would_give(gguf_file, qtype, monkeypatch):
    path = gguf_file("llama", qtype)
    monkeypatch.setattr(gguf_model, "_CACHE", {})
    read = gguf_model.read_gguf_model(path)
    facts = over_the_wire(model_facts(path, read.config), ModelFacts)
    assert facts.tensors is not None and len(facts.tensors) == len(read.tensors)
    monkeypatch.setattr(gguf_model, "_CACHE", {})
    parses = []
    monkeypatch.setattr(gguf_model, "open_gguf", lambda p: parses.append(p))
    config = config_from_facts(facts)
    assert config == read.config
    assert adopt_gguf_facts(path, facts, config)
    adopted = gguf_model.read_gguf_model(path)
    assert adopted == read  # path, architecture, config and tensor infos
    mapped = gguf_model.mapped_tensors(path)
    assert list(mapped) == list(read.data)
    for name, want in read.data.items():
        got = mapped[name]
        assert (got.tensor_type, got.n_bytes, got.data_offset) == (
            want.tensor_type,
            want.n_bytes,
            want.data_offset,
        )
        assert got.shape.tolist() == want.shape.tolist()
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data, want.data, equal_nan=True)
    assert parses == []


def test_a_file_changed_since_the_facts_is_read_again(gguf_file, tmp_path, fresh_process):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_file("llama", T.Q8_0).read_bytes())
    facts = model_facts(path, gguf_model.read_gguf_model(path).config)
    gguf_model._CACHE.clear()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert not adopt_gguf_facts(path, facts, config_from_facts(facts))
    assert gguf_model.cached_gguf_model(path) is None


def test_a_rank_spec_with_facts_builds_the_config_without_a_parse(
    gguf_file, model_factory, fresh_process, monkeypatch
):
    from cpud.protocol.launch import EngineSpec
    from cpud.ranks.worker import model_config

    for path in (gguf_file("llama", T.Q8_0), model_factory("llama")):
        want = load_model_config(path)
        resolved = ("auto", "shm", None, True, "auto")  # kernels ... quantization
        spec = EngineSpec(str(path), "float32", 1, 64, 16, 4, 64, True, 8, 0, *resolved)
        spec = msgspec.structs.replace(spec, model=model_facts(path, want))
        spec = over_the_wire(spec, EngineSpec)
        gguf_model._CACHE.clear()
        monkeypatch.setattr(gguf_model, "open_gguf", pytest.fail)
        assert model_config(spec) == want
        monkeypatch.undo()
        monkeypatch.setattr(gguf_model, "_CACHE", gguf_model._CACHE)


@pytest.mark.parametrize("kind", ["gguf", "gguf-spm", "hf", "override"])
def test_the_frontend_tokenizer_from_facts_equals_the_one_from_the_files(
    kind, gguf_file, model_factory, fresh_process
):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    path = {
        "gguf": lambda: gguf_file("qwen3", T.F32),
        "gguf-spm": lambda: gguf_file("llama", T.F32),
        "hf": lambda: model_factory("llama"),
        "override": lambda: model_factory("llama"),
    }[kind]()
    override = template if kind == "override" else None
    want = Tokenizer(path, override)
    got = Tokenizer.from_facts(over_the_wire(want.facts(), TokenizerFacts))
    for text in TEXTS:
        ids = want.encode(text)
        assert got.encode(text) == ids
        assert got.encode(text, add_special_tokens=False) == want.encode(text, False)
        assert got.decode(ids) == want.decode(ids)
        assert got.decode(ids, skip_special_tokens=False) == want.decode(ids, False)
    assert (got.vocab_size, got.eos_token_ids, got.specials) == (
        want.vocab_size,
        want.eos_token_ids,
        want.specials,
    )
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    assert got.chat_templates.templates == want.chat_templates.templates
    if want.chat_template is not None:
        assert got.apply_chat_template(MESSAGES) == want.apply_chat_template(MESSAGES)
