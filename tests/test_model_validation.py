"""A corrupt model directory is refused before any rank starts: one line naming the file and
the field or tensor, exit 2 from `cpud serve` (issue 20, defect 5)."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpud import LLM
from cpud.model.hf_config import parse_model_config
from cpud.settings.config import EngineArgs, resolve_config
from cpud.settings.errors import ConfigError
from cpud_server_helpers import free_port


@pytest.fixture
def model_copy(model_factory, tmp_path):
    def copy(arch: str = "llama", **kwargs) -> Path:
        dest = tmp_path / arch
        shutil.copytree(model_factory(arch, **kwargs), dest)
        return dest

    return copy


def refused(model_dir: Path, *needles: str) -> str:
    """resolve_config (what the supervisor, the frontend and LLM all pass) refuses the model
    with one line holding every needle."""
    with pytest.raises(ConfigError) as info:
        resolve_config(EngineArgs(dtype="float32", num_kv_blocks=8), model_dir)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    for needle in needles:
        assert needle in message, message
    return message


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def write_st(path: Path, header: dict, data: bytes, length: int | None = None) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)


def edit_header(model_dir: Path, change) -> Path:
    path = model_dir / "model.safetensors"
    header, data = read_st(path)
    change(header)
    write_st(path, header, data)
    return path


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))  # json.dumps writes NaN and Infinity literals


FIRST = "model.embed_tokens.weight"
SECOND = "model.layers.0.input_layernorm.weight"


# safetensors


def test_four_byte_safetensors(model_copy):
    d = model_copy()
    (d / "model.safetensors").write_bytes(b"\0\0\0\0")
    refused(d, "model.safetensors", "4 bytes")


def test_header_cut(model_copy):
    d = model_copy()
    path = d / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(raw[: 8 + length // 2])
    refused(d, "model.safetensors", "header")


def test_huge_header_length(model_copy):
    d = model_copy()
    path = d / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])
    refused(d, "model.safetensors", "header length")


def test_data_cut(model_copy):
    d = model_copy()
    path = d / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    refused(d, "model.safetensors", "truncated")


@pytest.mark.parametrize(
    "change, needles",
    [
        (lambda h: h[FIRST].update(data_offsets=[0, 1 << 40]), [FIRST, "data_offsets"]),
        (lambda h: h[FIRST].update(data_offsets=[-4, 0]), [FIRST, "data_offsets"]),
        (lambda h: h[FIRST].update(data_offsets=[8, 4]), [FIRST, "data_offsets"]),
        (lambda h: h[SECOND].update(data_offsets=[0, 256]), [FIRST, SECOND]),
        (lambda h: h[FIRST].update(shape=[576, 65]), [FIRST, "shape"]),
        (lambda h: h[FIRST].update(shape=[-576, -64]), [FIRST, "shape"]),
        (lambda h: h[FIRST].update(shape=[576, True]), [FIRST, "shape"]),
        (lambda h: h[FIRST].update(dtype="F31"), [FIRST, "F31"]),
        (lambda h: h[FIRST].update(dtype="F16"), [FIRST, "F16"]),
        (lambda h: h[FIRST].pop("data_offsets"), [FIRST, "data_offsets"]),
        (lambda h: h.update({FIRST: [1, 2]}), [FIRST]),
    ],
    ids=[
        "offset-past-file",
        "negative-offset",
        "reversed-offsets",
        "overlap",
        "shape-vs-bytes",
        "negative-shape",
        "bool-in-shape",
        "unknown-dtype",
        "dtype-vs-bytes",
        "no-offsets",
        "entry-not-object",
    ],
)
def test_bad_tensor_entries_name_the_tensor(model_copy, change, needles):
    d = model_copy()
    edit_header(d, change)
    refused(d, "model.safetensors", *needles)


@pytest.mark.parametrize(
    "header",
    [b"[1, 2, 3]", b"\xff\xfe{}", b"{not json", b'{"a": {"dtype": "F32", "shape": [NaN]}}'],
    ids=["list", "not-utf8", "not-json", "nan"],
)
def test_header_not_a_json_object(model_copy, header):
    d = model_copy()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    refused(d, "model.safetensors", "header")


def test_sharded_index_checked(model_copy):
    d = model_copy("qwen2", max_shard_bytes=40_000)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][name] = shards[1]
    index_path.write_text(json.dumps(index))
    refused(d, index_path.name, name, shards[1])

    index["weight_map"] = ["not", "a", "map"]
    index_path.write_text(json.dumps(index))
    refused(d, index_path.name, "weight_map")

    index["weight_map"] = {"x.weight": "../../etc/passwd"}
    index_path.write_text(json.dumps(index))
    refused(d, index_path.name, "../../etc/passwd")

    index_path.write_bytes(b"\xff\xfe")
    refused(d, index_path.name, "UTF-8")


def test_tensor_in_two_shards(model_copy):
    d = model_copy("qwen2", max_shard_bytes=40_000)
    (d / "model.safetensors.index.json").unlink()
    shards = sorted(d.glob("*.safetensors"))
    header, data = read_st(shards[0])
    other, _ = read_st(shards[1])
    name = next(n for n in other if n != "__metadata__")
    # The tensor is duplicated in the first shard, with its bytes appended.
    span = header[next(n for n in header if n != "__metadata__")]
    size = span["data_offsets"][1] - span["data_offsets"][0]
    header[name] = {**span, "data_offsets": [len(data), len(data) + size]}
    write_st(shards[0], header, data + data[:size])
    refused(d, name, shards[0].name, shards[1].name)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "opt"])
def test_valid_fixtures_pass_and_open(model_factory, arch):
    from safetensors import safe_open

    from cpud.model.safetensors_check import check_weights

    for kwargs in ({}, {"max_shard_bytes": 40_000}):
        d = model_factory(arch, **kwargs)
        files = check_weights(d)
        assert files
        for path in files:
            with safe_open(str(path), framework="numpy") as f:
                assert list(f.keys())
        resolve_config(EngineArgs(dtype="float32", num_kv_blocks=8), d)


def test_headers_only(tmp_path):
    """A 16 GiB tensor (a sparse file) is checked in milliseconds: only headers are read."""
    from cpud.model.safetensors_check import check_safetensors

    path = tmp_path / "model.safetensors"
    size = 1 << 34
    write_st(
        path, {"w": {"dtype": "BF16", "shape": [1 << 16, 1 << 17], "data_offsets": [0, size]}}, b""
    )
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size + size)
    start = time.perf_counter()
    assert list(check_safetensors(path)) == ["w"]
    assert time.perf_counter() - start < 0.5


def test_corrupt_files_also_fail_the_reader(tmp_path):
    """Every file the check accepts opens with the safetensors reader the ranks use, and the
    reader's own rules (contiguous, fully covered) are applied before any rank starts."""
    from safetensors import safe_open

    from cpud.model.safetensors_check import check_safetensors

    path = tmp_path / "model.safetensors"
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    gap = {"a": a, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}}
    for header, data in [(gap, b"\0" * 16), ({"a": a}, b"\0" * 12)]:
        write_st(path, header, data)
        with pytest.raises(ConfigError, match="model.safetensors"):
            check_safetensors(path)
        with pytest.raises(Exception):  # noqa: B017
            safe_open(str(path), framework="numpy")
    empty = {"a": a, "e": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [8, 8]}}
    write_st(path, {"__metadata__": {"format": "pt"}, **empty}, b"\0" * 8)
    assert sorted(check_safetensors(path)) == ["a", "e"]
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(f.keys()) == ["a", "e"]


# config.json


def test_config_not_utf8(model_copy):
    d = model_copy()
    (d / "config.json").write_bytes(b'{"hidden_size": "\xff\xfe"}')
    refused(d, "config.json", "UTF-8")


def test_config_json_list(model_copy):
    d = model_copy()
    (d / "config.json").write_text("[1, 2, 3]")
    refused(d, "config.json", "object")


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": "10000"}, "rope_theta"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": float("nan")}},
            "rope_scaling.factor",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": [1, 2]}, "rope_scaling"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"hidden_size": 64.5}, "hidden_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"intermediate_size": -192}, "intermediate_size"),
        ({"max_position_embeddings": 1 << 70}, "max_position_embeddings"),
        ({"num_attention_heads": 3, "head_dim": None}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 0}, "head_dim"),
        ({"head_dim": 15}, "head_dim"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"eos_token_id": ["</s>"]}, "eos_token_id"),
        ({"bos_token_id": "<s>"}, "bos_token_id"),
        ({"sliding_window": -5}, "sliding_window"),
        ({"torch_dtype": 16}, "torch_dtype"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
        ({"some_extra": float("-inf")}, "some_extra"),
    ],
)
def test_config_field_names_the_field(model_copy, changes, field):
    d = model_copy()
    edit_config(d, **changes)
    refused(d, "config.json", field)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"ffn_dim": "3072"}, "ffn_dim"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
        ({"word_embed_proj_dim": 0}, "word_embed_proj_dim"),
        ({"do_layer_norm_before": 1}, "do_layer_norm_before"),
    ],
)
def test_opt_config_fields(model_copy, changes, field):
    d = model_copy("opt")
    edit_config(d, **changes)
    refused(d, "config.json", field)


def test_integral_floats_and_nulls_still_parse():
    raw = json.loads(
        '{"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 64.0,'
        ' "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,'
        ' "vocab_size": 100, "num_key_value_heads": null, "head_dim": null,'
        ' "sliding_window": null, "rope_theta": 10000, "tie_word_embeddings": null}'
    )
    cfg = parse_model_config(raw)
    assert (cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (
        64,
        4,
        16,
        None,
    )
    assert cfg.rope_theta == 10000.0 and cfg.tie_word_embeddings is False


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[1, 2]", b"{"], ids=["bytes", "list", "cut"])
def test_tokenizer_side_json(model_copy, name, content):
    from cpud.text.tokenizer import Tokenizer

    d = model_copy()
    (d / name).write_bytes(content)
    refused(d, name)
    with pytest.raises(ConfigError, match=name):
        Tokenizer(d)


def test_offline_api_refuses_before_loading(model_copy):
    d = model_copy()
    edit_config(d, rope_theta=float("nan"))
    with pytest.raises(ConfigError, match="config.json.*rope_theta"):
        LLM(d, dtype="float32")
    d2 = model_copy("opt")
    path = d2 / "model.safetensors"
    path.write_bytes(path.read_bytes()[:4])
    with pytest.raises(ConfigError, match="model.safetensors"):
        LLM(d2, dtype="float32")


# cpud serve, end to end


def serve_corrupt(model_dir: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, float]:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    env = {**os.environ, "RUNTIME_DIRECTORY": str(runtime)}
    cmd = [sys.executable, "-m", "cpud.cli", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(free_port()), "--dtype", "float32"]
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.monotonic() - start
    assert list(runtime.iterdir()) == [], "a runtime directory was left behind"
    return result, elapsed


def assert_one_line_exit_2(result: subprocess.CompletedProcess, *needles: str) -> None:
    err = result.stderr
    assert result.returncode == 2, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpud: error: "), err
    for needle in needles:
        assert needle in lines[0], err


@pytest.mark.parametrize(
    "corrupt, needles",
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 4), ["model.safetensors"]),
        (
            lambda d: edit_header(d, lambda h: h[FIRST].update(data_offsets=[0, 1 << 40])),
            ["model.safetensors", FIRST],
        ),
        (lambda d: (d / "config.json").write_bytes(b"\xff{}"), ["config.json", "UTF-8"]),
        (lambda d: (d / "config.json").write_text("[]"), ["config.json"]),
        (lambda d: edit_config(d, rope_theta=float("nan")), ["config.json", "rope_theta"]),
        (lambda d: edit_config(d, hidden_size="64"), ["config.json", "hidden_size"]),
    ],
    ids=["4-bytes", "offsets", "config-not-utf8", "config-list", "rope-nan", "hidden-str"],
)
def test_serve_exits_2_with_one_line(model_copy, tmp_path, corrupt, needles):
    d = model_copy()
    corrupt(d)
    result, elapsed = serve_corrupt(d, tmp_path)
    assert_one_line_exit_2(result, *needles)
    assert elapsed < 30


def test_weights_that_disagree_with_config_exit_2_once_a_rank_finds_out(model_copy, tmp_path):
    """config.json and the safetensors headers are each valid but disagree: the rank that
    loads the tensor finds out, and the daemon stops with exit 2 (a restart cannot help)."""
    d = model_copy()
    edit_config(
        d, intermediate_size=json.loads((d / "config.json").read_text())["intermediate_size"] * 2
    )
    result, _ = serve_corrupt(d, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("cpud: error: ") and "does not match the weights" in last


def test_random_header_damage_is_a_config_error_or_readable(model_factory, tmp_path):
    """Random byte damage to a header: the check raises ConfigError (nothing else), and what
    it accepts the safetensors reader opens."""
    import random

    from safetensors import safe_open

    from cpud.model.safetensors_check import check_safetensors

    raw = (model_factory("llama") / "model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    path = tmp_path / "model.safetensors"
    rng = random.Random(20)
    accepted = 0
    for _ in range(300):
        damaged = bytearray(raw[: 8 + length + 64])
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(0, 8 + length)] = rng.randrange(256)
        path.write_bytes(bytes(damaged) + raw[8 + length + 64 :])
        try:
            check_safetensors(path)
        except ConfigError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            continue
        accepted += 1
        with safe_open(str(path), framework="numpy") as f:
            assert f.keys()
    assert accepted < 300


HOSTILE = [None, True, "7", -1, 0, 1.5, 2**70, float("nan"), [], {}, [1], {"a": 1}]
ROPE_SCALINGS = [
    {"rope_type": "linear", "factor": 2.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "attention_factor": 1.0,
        "truncate": False,
    },
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "opt"])
def test_any_field_value_parses_or_is_a_config_error(model_factory, arch):
    """What parses builds its rotary table: no hostile value gets past to fail in a rank."""
    import torch

    from cpud.ranks.layers.rotary import rope_inv_freq

    base = json.loads((model_factory(arch) / "config.json").read_text())
    cases = [{**base, key: value} for key in base for value in HOSTILE]
    for scaling in ROPE_SCALINGS:
        cases += [
            {**base, "rope_scaling": {**scaling, key: value}}
            for key in scaling
            for value in HOSTILE
        ]
    for raw in cases:
        try:
            cfg = parse_model_config(raw)
        except ConfigError as exc:
            assert "\n" not in str(exc)
            continue
        if cfg.family == "llama":
            inv_freq, scale = rope_inv_freq(
                cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
            )
            assert torch.isfinite(inv_freq).all() and math.isfinite(scale), raw
