"""The fixture-model generator: HF-loadable, deterministic, and decisive under greedy decoding."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import statistics
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from cpud.fixtures import ARCHS, PRESETS, default_model_dir, make_model
from cpud.fixtures.archs import ARCH_MODULES

# The built-in fixture architectures; each plug-in one (fixtures/archs/) is checked by its
# family's own tests (tests/test_family_*.py).
BUILTIN = tuple(arch for arch in ARCHS if arch not in ARCH_MODULES)

PROMPTS = [
    "The lighthouse keeper wrote",
    "def fibonacci(n):",
    "Le train est parti de la gare à sept heures",
    "清晨的市场很热闹。",
]
TEXTS = PROMPTS + [
    "Emoji 👨‍👩‍👧‍👦 🇯🇵 and Ελληνικά, ∑ᵢ aᵢ = 1\r\n\ttabs  and   spaces",
    "café vs cafe\u0301, ﬁ ligature, <|im_start|> </s> <s> [INST] <|eot_id|>",
]
HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "opt": "OPTForCausalLM",
}
TIED = {"llama": True, "mistral": False, "qwen2": False, "qwen3": True, "opt": True}
BOS = {"llama": "<|begin_of_text|>", "mistral": "<s>", "qwen2": None, "qwen3": None, "opt": "</s>"}


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models are all overhead; extra threads only add contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fixtures")
    return {arch: make_model(arch, "tiny", root / arch) for arch in BUILTIN}


@pytest.fixture(scope="module", params=BUILTIN)
def hf(request: pytest.FixtureRequest, model_dirs: dict[str, Path]):
    """(arch, dir, model, tokenizer, log text) loaded by transformers in fp32 eager."""
    transformers = pytest.importorskip("transformers")
    arch = request.param
    path = model_dirs[arch]
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(handler)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    finally:
        hf_logger.removeHandler(handler)
    assert not any(info.values()), info
    return arch, path, model.eval(), tokenizer, log.getvalue()


def test_unknown_names_are_rejected(tmp_path: Path) -> None:
    assert ARCHS[:5] == ("llama", "mistral", "qwen2", "qwen3", "opt")
    assert set(ARCHS[5:]) == set(ARCH_MODULES)  # the fixtures/archs/ plug-ins
    assert PRESETS == ("tiny", "qwen3-0.6b", "llama-3.2-1b")
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3, opt"):
        make_model("gpt2", "tiny", tmp_path)
    with pytest.raises(ValueError, match="tiny, qwen3-0.6b, llama-3.2-1b"):
        make_model("llama", "huge", tmp_path)
    with pytest.raises(ValueError, match="qwen3"):
        make_model("llama", "qwen3-0.6b", tmp_path)
    with pytest.raises(ValueError, match="llama"):
        make_model("qwen3", "llama-3.2-1b", tmp_path)
    with pytest.raises(ValueError, match="bfloat16"):
        make_model("llama", "tiny", tmp_path, dtype="int8")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arch", BUILTIN)
def test_files_and_config(arch: str, model_dirs: dict[str, Path]) -> None:
    path = model_dirs[arch]
    names = {f.name for f in path.iterdir()}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [HF_CLASS[arch]]
    assert config["model_type"] == arch
    assert config["torch_dtype"] == "float32"
    assert config["tie_word_embeddings"] is TIED[arch]

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    assert config["vocab_size"] % 64 == 0 and n_tok <= config["vocab_size"] < n_tok + 64

    with safe_open(path / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
        embed_name = next(k for k in keys if k.endswith("embed_tokens.weight"))
        embed = f.get_tensor(embed_name)
    assert ("lm_head.weight" in keys) is not TIED[arch]
    assert embed.shape[0] == config["vocab_size"]
    assert not embed[n_tok:].any() and embed[:n_tok].abs().sum(-1).min() > 0

    if arch != "opt":
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        assert heads // kv >= 2 and kv % 2 == 0
    if arch == "llama":
        assert config["rope_scaling"]["rope_type"] == "llama3"
        assert config["rope_scaling"]["original_max_position_embeddings"] < 1024
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in keys
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in keys
        assert config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]
    if arch == "opt":
        assert "model.decoder.embed_positions.weight" in keys
        assert "model.decoder.layers.1.fc2.bias" in keys


def test_transformers_loads_without_warnings(hf) -> None:
    arch, path, model, tokenizer, log = hf
    assert log == ""
    assert type(model).__name__ == HF_CLASS[arch]


def test_tokenizer_matches_transformers(hf) -> None:
    arch, path, model, tokenizer, log = hf
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in TEXTS:
        ids = raw.encode(text).ids
        assert tokenizer(text).input_ids == ids, text
        assert raw.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids)
    assert max(max(raw.encode(t).ids) for t in TEXTS) < len(tokenizer)

    first = raw.encode("Hello").ids[0]
    bos = BOS[arch]
    assert first == (
        raw.token_to_id(bos) if bos else raw.encode("Hello", add_special_tokens=False).ids[0]
    )
    assert tokenizer.bos_token == bos

    gen = json.loads((path / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert tokenizer.eos_token_id in eos and tokenizer.pad_token_id == gen["pad_token_id"]
    if arch == "opt":
        assert [raw.token_to_id(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]


def test_chat_template(hf) -> None:
    arch, path, model, tokenizer, log = hf
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Hi!" in text and "Be brief." in text
    marker = {
        "llama": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "mistral": "[/INST]",
        "qwen2": "<|im_start|>assistant\n",
        "qwen3": "<|im_start|>assistant\n",
        "opt": "assistant:",
    }[arch]
    assert text.endswith(marker)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    if BOS[arch] is not None:
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


def test_greedy_is_decisive(hf) -> None:
    arch, path, model, tokenizer, log = hf
    gaps = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = []
        with torch.no_grad():
            for _ in range(32):
                top = model(ids).logits[0, -1].topk(2)
                gaps.append((top.values[0] - top.values[1]).item())
                generated.append(top.indices[0].item())
                ids = torch.cat([ids, top.indices[:1].view(1, 1)], dim=1)
        assert len(set(generated)) >= 8, (prompt, generated)
    assert statistics.median(gaps) >= 0.3


def test_logits_do_not_depend_on_batch(hf) -> None:
    arch, path, model, tokenizer, log = hf
    tokenizer.padding_side = "right"
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1] * 3]
    with torch.no_grad():
        alone = [model(tokenizer(p, return_tensors="pt").input_ids).logits[0] for p in prompts]
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        together = model(**batch).logits
    for i, ref in enumerate(alone):
        diff = (together[i, : len(ref)] - ref).abs().max() / ref.abs().max()
        assert diff < 1e-4, (i, diff.item())


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = make_model("qwen3", "tiny", tmp_path / "a", seed=7)
    b = make_model("qwen3", "tiny", tmp_path / "b", seed=7)
    c = make_model("qwen3", "tiny", tmp_path / "c", seed=8)
    assert _digests(a) == _digests(b)
    differs = {k for k, v in _digests(c).items() if _digests(a)[k] != v}
    assert differs == {"model.safetensors"}


def test_sharding_keeps_values(tmp_path: Path) -> None:
    whole = make_model("llama", "tiny", tmp_path / "whole")
    limit = 40_000
    sharded = make_model("llama", "tiny", tmp_path / "sharded", max_shard_bytes=limit)
    files = sorted(sharded.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    ref, got = _tensors(whole), _tensors(sharded)
    assert ref.keys() == got.keys() == index["weight_map"].keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ref.values())
    for f in files:
        shard = load_file(f)
        assert all(index["weight_map"][k] == f.name for k in shard)
        assert len(shard) == 1 or sum(t.nbytes for t in shard.values()) <= limit


def test_dtype_override(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    path = make_model("mistral", "tiny", tmp_path, dtype="bfloat16")
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref, got = _tensors(model_dirs["mistral"]), _tensors(path)
    assert all(got[k].dtype == torch.bfloat16 for k in got)
    assert all(torch.equal(ref[k].to(torch.bfloat16), got[k]) for k in ref)


def test_default_model_dir_is_made_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPUD_CACHE_DIR", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path / "fixtures" and first.name.startswith("qwen3-tiny-s0")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "fixtures").iterdir()] == [first.name]


def test_corpus_has_multibyte_text() -> None:
    from importlib import resources

    text = resources.files("cpud.fixtures").joinpath("corpus.txt").read_text(encoding="utf-8")
    assert 20_000 <= len(text.encode()) <= 60_000
    for sample in ("é", "λ", "ж", "市", "ひ", "한", "🚀"):
        assert sample in text
