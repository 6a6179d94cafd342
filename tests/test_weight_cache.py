"""The weight cache: a rank's packed bf16 shard written on its first start and mapped (page-cache
pages, not copied) on later ones, rebuilt when stale or damaged, harmless when unwritable."""

from __future__ import annotations

import gc
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from test_huge_file_map import huge_share_when_read

from cpud import LLM, SamplingParams, native
from cpud.ranks.huge_file_map import HUGE
from cpud.ranks.layers.linear import PackableLinear
from cpud.ranks.weight_cache import ShardIdentity, WeightCache
from cpud.settings.config import EngineArgs, resolve_config
from cpud.settings.errors import ConfigError

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def greedy(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def load(model_dir: Path, cache: Path | str, **kw) -> LLM:
    return LLM(model_dir, dtype="bfloat16", kernels="native", weight_cache=str(cache), **kw)


def mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if line.rstrip().endswith(".bin")}


def cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


@pytest.fixture
def model_copy(model_factory, tmp_path) -> Path:
    """A private copy of the tiny qwen3 (tied embeddings), so tests may touch its files."""
    return Path(shutil.copytree(model_factory("qwen3"), tmp_path / "model"))


def test_second_start_maps_the_packed_shard_and_generates_the_same(model_copy, tmp_path):
    cache = tmp_path / "cache"
    reference = greedy(load(model_copy, "off"))
    assert not cache.exists()

    first = load(model_copy, cache)
    files = cache_files(cache)
    assert len(files) == 2 and {Path(f).suffix for f in files} == {".bin", ".json"}
    bin_path = str(next(cache.glob("*.bin")))
    assert greedy(first) == reference

    second = load(model_copy, cache)
    assert bin_path in mapped_files()
    assert cache_files(cache) == files
    model = second.engine.executor.runner.model
    linears = [m for m in model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    # Tied: the embedding looks rows up in the (mapped) LM head table.
    assert model.model.embed_tokens.packed is model.lm_head.packed
    assert greedy(second) == reference


def test_untied_head_and_biases_come_back_from_the_cache(model_factory, tmp_path):
    model_dir = model_factory("qwen2")  # qkv bias, untied lm_head
    cache = tmp_path / "cache"
    reference = greedy(load(model_dir, "off"))
    load(model_dir, cache)
    cached = load(model_dir, cache)
    assert str(next(cache.glob("*.bin"))) in mapped_files()
    qkv = cached.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed.bias is not None
    assert greedy(cached) == reference


def test_a_changed_checkpoint_rebuilds_the_cache_and_drops_the_old_file(model_copy, tmp_path):
    cache = tmp_path / "cache"
    load(model_copy, cache)
    old = cache_files(cache)
    weights = next(model_copy.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    llm = load(model_copy, cache)
    new = cache_files(cache)
    assert len(new) == 2 and set(new).isdisjoint(old)
    assert greedy(llm) == greedy(load(model_copy, "off"))


def test_a_truncated_cache_file_is_rebuilt(model_copy, tmp_path, caplog):
    cache = tmp_path / "cache"
    reference = greedy(load(model_copy, cache))
    data = next(cache.glob("*.bin"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        llm = load(model_copy, cache)
    assert "truncated" in caplog.text
    assert greedy(llm) == reference
    assert str(data) not in mapped_files()  # packed again from the checkpoint...
    third = load(model_copy, cache)
    assert str(data) in mapped_files()  # ...and written whole for the next start
    assert greedy(third) == reference


def test_a_cache_of_other_shapes_is_not_used(model_copy, tmp_path, caplog):
    cache = tmp_path / "cache"
    reference = greedy(load(model_copy, cache))
    index = next(cache.glob("*.json"))
    index.write_text(index.read_text().replace('"shape": [', '"shape": [1, '))
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        llm = load(model_copy, cache)
    assert "does not match" in caplog.text
    assert greedy(llm) == reference


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda text: text.replace('"offset"', '"offs"'), "damaged index"),
        (lambda text: text[: len(text) // 2], "unreadable"),
        (lambda text: text.replace('"offset": 0', '"offset": 1099511627776'), "does not match"),
    ],
)
def test_a_damaged_index_is_rebuilt(model_copy, tmp_path, caplog, damage, message):
    cache = tmp_path / "cache"
    reference = greedy(load(model_copy, cache))
    index = next(cache.glob("*.json"))
    index.write_text(damage(index.read_text()))
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        llm = load(model_copy, cache)
    assert message in caplog.text
    assert greedy(llm) == reference
    assert greedy(load(model_copy, cache)) == reference  # rewritten whole


def test_an_unwritable_cache_directory_only_warns(model_copy, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    with caplog.at_level(logging.WARNING, logger="cpud.ranks"):
        llm = load(model_copy, blocker / "cache")
    assert "cannot write" in caplog.text and "--weight-cache" in caplog.text
    assert greedy(llm) == greedy(load(model_copy, "off"))


def test_off_and_unpacked_dtypes_write_nothing(model_copy, tmp_path):
    cache = tmp_path / "cache"
    load(model_copy, "off")
    LLM(model_copy, dtype="float32", kernels="native", weight_cache=str(cache))
    LLM(model_copy, dtype="bfloat16", kernels="torch", weight_cache=str(cache))
    assert cache_files(cache) == []


def test_weight_cache_setting_resolves(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("CPUD_CACHE_DIR", str(tmp_path / "root"))
    auto = resolve_config(EngineArgs(model=model_copy), model_copy)
    assert auto.weight_cache == str(tmp_path / "root" / "packed")
    assert resolve_config(EngineArgs(weight_cache="off"), model_copy).weight_cache is None
    given = resolve_config(EngineArgs(weight_cache="~/w"), model_copy).weight_cache
    assert given == str(Path.home() / "w")
    with pytest.raises(ConfigError, match="weight_cache must be auto, off or a directory"):
        resolve_config(EngineArgs(weight_cache=""), model_copy)


def test_tp2_ranks_each_map_their_own_shard(model_copy, tmp_path):
    cache = tmp_path / "cache"
    # TP=2 without the cache: bf16 partial sums round differently from TP=1's full sums, so
    # greedy tokens of the two degrees need not agree on random weights (they do at fp32).
    with load(model_copy, "off", tp=2, collective="shm") as uncached:
        reference = greedy(uncached)
    first = load(model_copy, cache, tp=2, collective="shm")
    assert greedy(first) == reference
    first.shutdown()
    assert len(list(cache.glob("*.bin"))) == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.glob("*.bin")}
    second = load(model_copy, cache, tp=2, collective="shm")
    assert greedy(second) == reference
    second.shutdown()
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("*.bin")} == stamps


def test_mapped_weights_are_the_page_cache_not_a_copy(model_copy, tmp_path):
    cache = tmp_path / "cache"
    load(model_copy, cache)
    llm = load(model_copy, cache)
    qkv = llm.engine.executor.runner.model.model.layers[0].self_attn.qkv_proj.packed.data
    address = qkv.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, path = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                assert path.endswith(".bin") and "r--s" in line
                break
        else:
            pytest.fail("packed weights are not in any mapping")
    assert qkv.dtype == torch.bfloat16


def test_the_file_packs_small_tensors_and_its_first_map_reads_nothing_again(tmp_path, caplog):
    g = torch.Generator().manual_seed(3)
    tensors = {f"layers.{i}.qkv": torch.randn(160, 128, generator=g) for i in range(40)}
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}  # 40 KiB each
    tensors["lm_head.qs"] = torch.randint(0, 256, (3 * HUGE + 999,), dtype=torch.uint8)
    cache = WeightCache(tmp_path, ShardIdentity(str(tmp_path / "none"), "torch.bfloat16", 1, 0, 16))
    cache.store(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert cache.data_path.stat().st_size == -(-nbytes // HUGE) * HUGE  # no page per tensor
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    with caplog.at_level(logging.INFO, logger="cpud.ranks"):
        views = cache.load(shapes, {"lm_head.qs": torch.uint8})
    assert views is not None and all(torch.equal(views[n], t) for n, t in tensors.items())
    (line,) = [r.getMessage() for r in caplog.records if "mapped from" in r.getMessage()]
    del views
    gc.collect()
    best = huge_share_when_read(cache.data_path)
    if best:  # as just written: in 2 MiB folios, none read again
        assert f"{100 * best:.0f} % on 2 MiB pages" in line and "read again" not in line, line
