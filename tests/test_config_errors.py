"""Bad configuration fails with a one-line reason, from the API and from the CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from cpud import LLM, SamplingParams
from cpud.model.cpu_features import resolve_dtype
from cpud.settings.errors import ConfigError, RequestError


@pytest.fixture
def model_copy(model_factory, tmp_path):
    def copy(arch: str = "llama"):
        dest = tmp_path / arch
        shutil.copytree(model_factory(arch), dest)
        return dest

    return copy


def edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def expect_config_error(match: str, model_dir, **kwargs) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        LLM(model_dir, dtype=kwargs.pop("dtype", "float32"), **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    return message


def test_missing_directory(tmp_path):
    expect_config_error("does not exist", tmp_path / "nope")


def test_missing_config(model_copy):
    d = model_copy()
    (d / "config.json").unlink()
    expect_config_error("config.json is missing", d)


def test_invalid_config_json(model_copy):
    d = model_copy()
    (d / "config.json").write_text("{not json")
    expect_config_error("not valid JSON", d)


def test_unsupported_architecture(model_copy):
    d = model_copy()
    edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    message = expect_config_error("not supported", d)
    assert "Llama, " in message and "ForCausalLM" in message  # says what would work


def test_no_weights(model_copy):
    d = model_copy()
    (d / "model.safetensors").unlink()
    expect_config_error("no \\*.safetensors", d)


def test_missing_tensor(model_copy):
    d = model_copy()
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    expect_config_error("lacks model.layers.1.mlp.down_proj.weight", d)


def test_shape_mismatch(model_copy):
    d = model_copy()
    cfg = json.loads((d / "config.json").read_text())
    edit_config(d, intermediate_size=cfg["intermediate_size"] * 2)
    expect_config_error("does not match the weights", d)


def test_index_lists_missing_shard(model_factory, tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(model_factory("qwen2", max_shard_bytes=40_000), d)
    next(d.glob("model-00002-*.safetensors")).unlink()
    expect_config_error("which is missing", d)


def test_missing_tokenizer(model_copy):
    d = model_copy()
    (d / "tokenizer.json").unlink()
    expect_config_error("tokenizer.json is missing", d)


def test_unknown_dtype(model_copy):
    expect_config_error("unsupported dtype 'int3'", model_copy(), dtype="int3")


def test_dtype_the_cpu_cannot_do():
    with pytest.raises(ConfigError, match="bfloat16 needs .*use --dtype float32"):
        resolve_dtype("bfloat16", flags=frozenset({"sse4_2", "avx"}))
    with pytest.raises(ConfigError, match="float16 needs"):
        resolve_dtype("float16", flags=frozenset({"avx2", "f16c"}))
    # auto keeps the checkpoint's dtype: bf16 (emulated by the native kernels on AVX2) for bf16,
    # fp16 and unlabelled weights; fp32 checkpoints stay fp32; no bf16 without native kernels
    # below AVX512-BF16 or below AVX2.
    assert resolve_dtype("auto", flags=frozenset({"avx2", "fma"})) == "bfloat16"
    assert resolve_dtype("auto", frozenset({"avx2", "fma"}), "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", frozenset({"avx512f"}), "float16") == "bfloat16"
    assert resolve_dtype("auto", frozenset({"amx_bf16", "avx512_bf16"}), "float32") == "float32"
    assert resolve_dtype("auto", frozenset({"avx2", "fma"}), kernels="torch") == "float32"
    assert resolve_dtype("auto", frozenset({"amx_bf16"}), "bfloat16", kernels="torch") == "bfloat16"
    assert resolve_dtype("auto", frozenset({"sse4_2", "avx"}), "bfloat16") == "float32"
    assert resolve_dtype("bfloat16", flags=frozenset({"avx2", "fma"})) == "bfloat16"
    assert resolve_dtype("auto", flags=frozenset({"avx512_bf16"})) == "bfloat16"


def test_context_and_block_limits(model_copy):
    d = model_copy()
    expect_config_error("exceeds the model's max_position_embeddings", d, max_model_len=10**6)
    expect_config_error("multiple of 16", d, block_size=24)
    expect_config_error("must be positive", d, max_num_seqs=0)


def test_request_errors_name_the_field(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", max_model_len=64)
    cases = [
        ([], "prompt", "empty"),
        ([10**7], "prompt", "outside the vocabulary"),
        (list(range(5, 69)), "prompt", "context is 64"),
    ]
    for prompt, param, text in cases:
        with pytest.raises(RequestError, match=text) as info:
            llm.generate([prompt], SamplingParams(max_tokens=4))
        assert info.value.param == param
    with pytest.raises(RequestError, match="max_tokens 100 is too large") as info:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=100))
    assert info.value.code == "context_length_exceeded"
    # The engine is still usable and holds nothing after the failures.
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
    assert llm.engine.blocks.num_free == llm.config.num_kv_blocks


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cpud.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_reports_one_line_and_exit_code(model_copy, tmp_path):
    d = model_copy()
    edit_config(d, architectures=["BertModel"])
    result = run_cli("generate", "--model", str(d))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("cpud: error: ") and "Traceback" not in result.stderr
    missing = run_cli("generate", "--model", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_cli_generates_and_makes_models(tmp_path, model_factory):
    made = run_cli("model", "make", "--arch", "opt", "--preset", "tiny", str(tmp_path / "m"))
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "m" / "config.json").is_file()
    result = run_cli(
        "generate", "--model", str(tmp_path / "m"), "--max-tokens", "5", "--json", "Hello"
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)["outputs"][0]
    assert out["prompt"] == "Hello" and len(out["token_ids"]) <= 5
    bad = run_cli("model", "make", "--arch", "gpt9", str(tmp_path / "x"))
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_kernels_choice_without_native_library(monkeypatch):
    from cpud import native
    from cpud.ranks.ops import make_ops

    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.setattr(native, "load_error", lambda: "no compiler")
    assert make_ops("auto").name == "torch"
    with pytest.raises(ConfigError, match="native kernels are not built .*--kernels torch"):
        make_ops("native")
    with pytest.raises(ConfigError, match="kernels 'fast' is not one of"):
        make_ops("fast")


def test_kv_cache_that_does_not_fit_memory_is_refused_with_numbers(model_factory):
    with pytest.raises(ConfigError, match="GiB") as info:
        LLM(model_factory("llama"), dtype="float32", num_kv_blocks=10**9)
    assert "\n" not in str(info.value)
