"""Embeddings on the rank side: pooled vectors from ModelRunner (SeqWork.embed) against
sentence-transformers on the same fixture (cosine >= 0.999 in fp32, >= 0.99 in bf16), for the
BERT encoder (CLS and mean pooling, with and without Normalize) and a Qwen3 decoder (last token
and mean), from Hugging Face directories and GGUF files (pooling_type); TP=2 against TP=1; an
embedding sequence in a step beside generating sequences leaves their tokens unchanged; the
pooling declarations read from the files, and what cpud refuses."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file
from test_tp_sharding import ThreadGroupHub, ThreadRank, run_ranks

from cpud.fixtures.sentence_transformers import sentence_transformers_files
from cpud.model.load import load_model_config
from cpud.model.pooling_config import gguf_pooling, sentence_transformers_pooling
from cpud.protocol.step import SeqWork, StepPlan, StepResult
from cpud.ranks.model_runner import ModelRunner, RunnerConfig
from cpud.ranks.parallel import SingleRank
from cpud.settings.errors import ConfigError

BLOCK = 16
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "short",
    "Embeddings turn a whole sentence into one vector, pooled over its tokens.",
    "hello world",
]
FP32_COSINE = 0.999
BF16_COSINE = 0.99


def with_pooling(source: Path, out: Path, pooling: str, normalize: bool) -> Path:
    """A copy of fixture `source` whose sentence-transformers files declare this pooling."""
    if not out.exists():
        shutil.copytree(source, out)
        shutil.rmtree(out / "1_Pooling")
        hidden = json.loads((source / "config.json").read_text())["hidden_size"]
        for name, content in sentence_transformers_files(hidden, pooling, normalize, 512).items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(json.dumps(content))
    return out


@pytest.fixture(scope="module")
def fixtures(model_factory, tmp_path_factory):
    """name -> fixture directory: bert (CLS, normalised), bert-mean (mean, not normalised),
    qwen3 (last token, normalised), qwen3-mean (mean, normalised)."""
    root = tmp_path_factory.mktemp("embedding-fixtures")
    bert, qwen3 = model_factory("bert"), model_factory("qwen3_embed")
    return {
        "bert": bert,
        "bert-mean": with_pooling(bert, root / "bert-mean", "mean", False),
        "qwen3": qwen3,
        "qwen3-mean": with_pooling(qwen3, root / "qwen3-mean", "mean", True),
    }


@pytest.fixture(scope="module")
def reference():
    """(fixture dir) -> (token lists, sentence-transformers' fp32 embeddings [N, H]): TEXTS as
    its tokenizer encodes them, then two random prompts of one length (one attention batch)."""
    from sentence_transformers import SentenceTransformer

    cache: dict[str, tuple[list[list[int]], torch.Tensor]] = {}

    def get(model_dir: Path) -> tuple[list[list[int]], torch.Tensor]:
        key = str(model_dir)
        if key not in cache:
            st = SentenceTransformer(str(model_dir), device="cpu")
            encoded = [st.tokenizer(t)["input_ids"] for t in TEXTS]
            rng = np.random.default_rng(7)
            around = st.tokenizer("")["input_ids"]  # the specials around every input, if any
            first, last = around[:1], around[1:]
            randoms = [first + [int(t) for t in rng.integers(5, 500, 40)] + last for _ in (0, 1)]
            tokens = encoded + randoms
            with torch.inference_mode():
                vectors = [
                    st(
                        {
                            "input_ids": torch.tensor([ids]),
                            "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                        }
                    )["sentence_embedding"][0]
                    for ids in tokens
                ]
            want = torch.stack(vectors).float()
            # the batch-free reference is sentence-transformers' encode() of the same texts
            canonical = st.encode(TEXTS, convert_to_tensor=True).float()
            torch.testing.assert_close(canonical, want[: len(TEXTS)], rtol=1e-4, atol=1e-5)
            cache[key] = (tokens, want)
        return cache[key]

    return get


def embed_plan(tokens: list[list[int]], step: int = 0, first_seq: int = 0) -> StepPlan:
    works, block = [], 0
    for i, ids in enumerate(tokens):
        blocks = -(-len(ids) // BLOCK)
        table = list(range(block, block + blocks))
        works.append(SeqWork(first_seq + i, ids, 0, table, True, embed=True))
        block += blocks
    return StepPlan(step, works)


def make_runner(
    path: Path,
    dtype: torch.dtype = torch.float32,
    kernels: str = "torch",
    group=None,
) -> ModelRunner:
    config = RunnerConfig(path, dtype, 512, BLOCK, 64, kernels=kernels, kv_pretouch=False)
    return ModelRunner(config, load_model_config(path), group or SingleRank())


def vectors(result: StepResult) -> torch.Tensor:
    return torch.stack(
        [torch.from_numpy(np.frombuffer(e.vector, dtype="<f4").copy()) for e in result.embeddings]
    )


def cosines(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(got, want, dim=-1)


def check_against_reference(run: ModelRunner, tokens, want, least: float) -> torch.Tensor:
    result = run.execute(embed_plan(tokens))
    assert result.tokens == [], "an embedding sequence samples no token"
    assert [e.seq_id for e in result.embeddings] == list(range(len(tokens)))
    got = vectors(result)
    assert got.shape == want.shape
    found = cosines(got, want)
    assert float(found.min()) >= least, found
    # the reference tells the inputs apart: a check with teeth
    others = cosines(want[:, None], want[None]) + 2 * torch.eye(len(want))
    assert float(others.min()) < 0.95
    return got


SLOW = pytest.mark.slow
FP32_CASES = ["bert", pytest.param("bert-mean", marks=SLOW), "qwen3", "qwen3-mean"]
BF16_CASES = ["bert", "bert-mean", "qwen3", "qwen3-mean"]


@pytest.mark.parametrize("name", FP32_CASES)
def test_fp32_embeddings_equal_sentence_transformers(name, fixtures, reference):
    tokens, want = reference(fixtures[name])
    run = make_runner(fixtures[name])
    got = check_against_reference(run, tokens, want, FP32_COSINE)
    pooling, normalize = run.model_cfg.embedding_pooling
    norms = got.norm(dim=-1)
    if normalize:
        torch.testing.assert_close(norms, torch.ones_like(norms))
    else:  # the mean of the hidden states as it is, at its own length
        torch.testing.assert_close(norms, want.norm(dim=-1), rtol=1e-3, atol=1e-4)


@SLOW
@pytest.mark.parametrize("name", BF16_CASES)
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_bf16_embeddings_equal_sentence_transformers(name, kernels, fixtures, reference):
    tokens, want = reference(fixtures[name])
    run = make_runner(fixtures[name], torch.bfloat16, kernels)
    if kernels == "native" and name.startswith("qwen3"):
        assert run.decoder is not None, "not the fused decoder"
    check_against_reference(run, tokens, want, BF16_COSINE)


@SLOW
@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_gguf_embeddings_equal_sentence_transformers(name, fixtures, reference, gguf_file):
    arch = {"bert": "bert", "qwen3": "qwen3_embed"}[name]
    path = gguf_file(arch, T.F16)
    config = load_model_config(path)
    assert (config.pooling, config.normalize) == (load_model_config(fixtures[name]).pooling, True)
    tokens, want = reference(fixtures[name])
    check_against_reference(make_runner(path), tokens, want, FP32_COSINE)
    check_against_reference(make_runner(path, torch.bfloat16, "native"), tokens, want, BF16_COSINE)


WORDPIECE_TEXTS = [
    *TEXTS,
    "Café naïve résumé, $5 + 3 = 8!",
    "中文 test",
    "  Hello,\tWorld!\n New  line [CLS] here [MASK]",
    "supercalifragilisticexpialidocious xyzzy",
]


def test_gguf_wordpiece_tokenizer_equals_the_directorys(fixtures, gguf_file):
    """A `bert` GGUF file's WPM vocabulary (phantom spaces) builds the WordPiece tokenizer of
    the directory it was converted from: same ids, [CLS] and [SEP] around each text."""
    from tokenizers import Tokenizer as HFTokenizer

    from cpud.text.tokenizer import Tokenizer

    ours = Tokenizer(gguf_file("bert", T.F16))
    theirs = HFTokenizer.from_file(str(fixtures["bert"] / "tokenizer.json"))
    for text in WORDPIECE_TEXTS:
        assert ours.encode(text) == theirs.encode(text).ids, text
    assert ours.decode(ours.encode(TEXTS[0])) == TEXTS[0].lower()


def test_gguf_wordpiece_without_its_special_ids_is_refused(tmp_path):
    import gguf

    from cpud.text.gguf_tokenizer import read_vocab

    path = tmp_path / "wpm.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[UNK]", "\u2581a", "b"])
    writer.add_token_types([gguf.TokenType.CONTROL, gguf.TokenType.NORMAL, gguf.TokenType.NORMAL])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="a bert tokenizer needs tokenizer.ggml.bos_token_id"):
        read_vocab(path)


@SLOW
def test_llm_embeds_a_bert_gguf_file_as_sentence_transformers_does(fixtures, gguf_file):
    """Text to vector through the offline LLM on the GGUF file (its own tokenizer)."""
    from sentence_transformers import SentenceTransformer

    from cpud import LLM

    want = SentenceTransformer(str(fixtures["bert"]), device="cpu").encode(
        WORDPIECE_TEXTS, convert_to_tensor=True
    )
    llm = LLM(gguf_file("bert", T.F16), dtype="float32")
    got = torch.tensor([out.outputs.embedding for out in llm.embed(WORDPIECE_TEXTS)])
    llm.shutdown()
    assert float(cosines(got, want).min()) >= FP32_COSINE


def sharded_result(path: Path, plan: StepPlan, tp: int) -> StepResult:
    hub = ThreadGroupHub(tp)
    runners = [make_runner(path, group=ThreadRank(hub, r)) for r in range(tp)]
    results = run_ranks(hub, [runner.execute for runner in runners], plan)
    assert all(r is None for r in results[1:]), "only rank 0 answers"
    return results[0]


@pytest.mark.parametrize("name", ["qwen3", pytest.param("qwen3-mean", marks=SLOW), "bert"])
def test_tp2_equals_tp1(name, fixtures, reference):
    tokens, _ = reference(fixtures[name])
    plan = embed_plan(tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        full = vectors(make_runner(fixtures[name]).execute(plan))
        sharded = vectors(sharded_result(fixtures[name], plan, 2))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(sharded, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kernels", [pytest.param("native", marks=SLOW), "torch"])
def test_embedding_beside_generation_leaves_tokens_unchanged(kernels, fixtures, reference):
    """Two greedy generations over six steps, alone and with embedding sequences in steps 0 and
    2 (their KV in blocks of their own): the same tokens; the embeddings equal those of a step
    of their own."""
    path = fixtures["qwen3"]
    tokens, _ = reference(path)
    prompts = [tokens[0] + tokens[2], tokens[4]]

    def generate(embed_at: dict[int, list[list[int]]]) -> tuple[list[list[int]], list]:
        run = make_runner(path, kernels=kernels)
        outputs: list[list[int]] = [[], []]
        found = []
        for step in range(6):
            works = []
            for seq, prompt in enumerate(prompts):
                table = list(range(seq * 8, seq * 8 + 8))  # blocks 0-15: the generations'
                if step == 0:
                    works.append(SeqWork(seq, prompt, 0, table, True))
                else:
                    pos = len(prompt) + step - 1
                    works.append(SeqWork(seq, [outputs[seq][-1]], pos, table, True))
            extra = embed_at.get(step, [])
            plan = embed_plan(extra, step, first_seq=100)
            moved = [
                SeqWork(w.seq_id, w.token_ids, 0, [b + 16 for b in w.block_ids], True, embed=True)
                for w in plan.seqs
            ]
            result = run.execute(StepPlan(step, works[:1] + moved + works[1:]))
            for sampled in result.tokens:
                outputs[sampled.seq_id].append(sampled.token_id)
            found += result.embeddings
        return outputs, found

    alone, none = generate({})
    mixed, embedded = generate({0: tokens[:3], 2: tokens[3:5]})
    assert none == []
    assert mixed == alone
    assert len({t for out in alone for t in out}) > 3, "degenerate continuations"
    assert [e.seq_id for e in embedded] == [100, 101, 102, 100, 101]
    got = torch.stack(
        [torch.from_numpy(np.frombuffer(e.vector, dtype="<f4").copy()) for e in embedded]
    )
    own = vectors(make_runner(path, kernels=kernels).execute(embed_plan(tokens[:5])))
    torch.testing.assert_close(got, own, rtol=1e-4, atol=1e-5)


def test_bert_checkpoint_names_of_task_heads_load(fixtures, reference, tmp_path):
    """`bert.`-prefixed names with LayerNorm gamma/beta (older BertFor* checkpoints) and no
    pooler load into the same encoder."""
    source = fixtures["bert"]
    out = tmp_path / "bert-old-names"
    shutil.copytree(source, out)
    renamed = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if name.startswith("pooler."):
            continue
        if name.endswith("LayerNorm.weight"):
            name = name.removesuffix("weight") + "gamma"
        elif name.endswith("LayerNorm.bias"):
            name = name.removesuffix("bias") + "beta"
        renamed["bert." + name] = tensor
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokens, want = reference(source)
    check_against_reference(make_runner(out), tokens, want, FP32_COSINE)


def test_decoder_saved_as_its_base_model_loads(fixtures, reference, tmp_path):
    """sentence-transformers' export of a decoder (Qwen3-Embedding): Qwen3Model's names without
    `model.`, no LM head although config.json says the head is not tied."""
    source = fixtures["qwen3"]
    out = tmp_path / "qwen3-base-model"
    shutil.copytree(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    base = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    assert "lm_head.weight" not in base
    save_file(base, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text()) | {"tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config))
    assert load_model_config(out).tie_word_embeddings
    tokens, want = reference(source)
    check_against_reference(make_runner(out), tokens, want, FP32_COSINE)


def test_encoder_refuses_what_it_cannot_run(fixtures):
    run = make_runner(fixtures["bert"])
    generating = StepPlan(0, [SeqWork(0, [2, 50, 3], 0, [], True)])
    with pytest.raises(ValueError, match="embedding model"):
        run.execute(generating)
    partial = StepPlan(0, [SeqWork(0, [50, 3], 4, [], True, embed=True)])
    with pytest.raises(ValueError, match="whole in one step"):
        run.execute(partial)
    too_long = StepPlan(0, [SeqWork(0, list(range(5, 5 + 600)), 0, [], True, embed=True)])
    with pytest.raises(ValueError, match="position embeddings"):
        run.execute(too_long)


# --- what the files declare ----------------------------------------------------------------


def test_declared_pooling(fixtures, model_factory):
    bert = load_model_config(fixtures["bert"])
    assert (bert.pooling, bert.normalize, bert.generates) == ("cls", True, False)
    assert load_model_config(fixtures["bert-mean"]).embedding_pooling == ("mean", False)
    qwen3 = load_model_config(fixtures["qwen3"])
    assert (qwen3.pooling, qwen3.normalize, qwen3.generates) == ("last", True, True)
    plain = load_model_config(model_factory("qwen3"))
    assert plain.pooling is None and plain.embedding_pooling == ("last", True)
    undeclared = replace(bert, pooling=None, normalize=False)
    assert undeclared.embedding_pooling == ("cls", True)


def write_modules(root: Path, modules: list[dict], pooling: dict | None) -> Path:
    root.mkdir()
    (root / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (root / "1_Pooling").mkdir()
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return root


TRANSFORMER = {
    "idx": 0,
    "name": "0",
    "path": "",
    "type": "sentence_transformers.models.Transformer",
}
POOLING = {
    "idx": 1,
    "name": "1",
    "path": "1_Pooling",
    "type": "sentence_transformers.models.Pooling",
}
NORMALIZE = {
    "idx": 2,
    "name": "2",
    "path": "2_Normalize",
    "type": "sentence_transformers.models.Normalize",
}


@pytest.mark.parametrize(
    ("pooling", "normalize", "want"),
    [
        ({"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, True, "last"),
        ({"pooling_mode_cls_token": True}, False, "cls"),
        ({"word_embedding_dimension": 8}, False, "mean"),  # sentence-transformers' default
        ({"pooling_mode": "lasttoken"}, True, "last"),  # its newer form
        ({"pooling_mode": ["cls"]}, True, "cls"),
    ],
)
def test_sentence_transformers_pooling_forms(pooling, normalize, want, tmp_path):
    modules = [TRANSFORMER, POOLING] + ([NORMALIZE] if normalize else [])
    root = write_modules(tmp_path / "m", modules, pooling)
    assert sentence_transformers_pooling(root) == {"pooling": want, "normalize": normalize}


@pytest.mark.parametrize(
    ("modules", "pooling", "message"),
    [
        ([TRANSFORMER, POOLING], {"pooling_mode_max_tokens": True}, "mode 'max' is not supported"),
        (
            [TRANSFORMER, POOLING],
            {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True},
            "concatenated",
        ),
        (
            [
                TRANSFORMER,
                POOLING,
                {"path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            ],
            {"pooling_mode_mean_tokens": True},
            "Dense.* is not supported",
        ),
        ([TRANSFORMER, POOLING], None, "1_Pooling/config.json"),
        ([{"path": ""}], None, "must be a list of modules"),
    ],
)
def test_sentence_transformers_files_cpud_refuses(modules, pooling, message, tmp_path):
    root = write_modules(tmp_path / "m", modules, pooling)
    with pytest.raises(ConfigError, match=message):
        sentence_transformers_pooling(root)


def test_gguf_pooling_types():
    assert gguf_pooling(None, "f.gguf", "bert.pooling_type") == {}
    assert gguf_pooling(0, "f.gguf", "bert.pooling_type") == {}
    assert gguf_pooling(2, "f.gguf", "bert.pooling_type") == {"pooling": "cls", "normalize": True}
    with pytest.raises(ConfigError, match="rank pooling .rerankers. is not supported"):
        gguf_pooling(4, "f.gguf", "bert.pooling_type")
    with pytest.raises(ConfigError, match="bert.pooling_type must be"):
        gguf_pooling("mean", "f.gguf", "bert.pooling_type")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key'"),
        ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ({"num_attention_heads": 5}, "not a multiple of num_attention_heads 5"),
        ({"is_decoder": True}, "BERT decoder"),
    ],
)
def test_bert_configs_cpud_refuses(change, message, fixtures, tmp_path):
    out = tmp_path / "bert"
    shutil.copytree(fixtures["bert"], out)
    config = json.loads((out / "config.json").read_text()) | change
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        load_model_config(out)
