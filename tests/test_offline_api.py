"""The vLLM-shaped offline API: prompts in, RequestOutputs back in order."""

from __future__ import annotations

import pytest

from cpud import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llama(model_factory):
    return LLM(model=model_factory("llama"), dtype="float32")


def test_string_and_token_prompts_in_order(llama):
    text_prompts = ["Hello there", "A longer prompt about the weather today"]
    ids = llama.tokenizer.encode(text_prompts[1])
    outputs = llama.generate(
        [text_prompts[0], ids, text_prompts[1]], SamplingParams(max_tokens=6, temperature=0)
    )
    assert all(isinstance(o, RequestOutput) and o.finished for o in outputs)
    assert outputs[0].prompt == "Hello there"
    assert outputs[0].prompt_token_ids == llama.tokenizer.encode("Hello there")
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == ids
    # The same prompt as text and as ids gives the same greedy continuation.
    assert outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert outputs[2].outputs[0].text == llama.tokenizer.decode(outputs[2].outputs[0].token_ids)


def test_single_prompt_and_per_prompt_params(llama):
    one = llama.generate("Hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(one) == 1 and len(one[0].outputs[0].token_ids) == 3
    two = llama.generate(
        ["Hi", "Hi"],
        [
            SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        ],
    )
    assert [len(o.outputs[0].token_ids) for o in two] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llama.generate(["Hi"], [SamplingParams(), SamplingParams()])


def test_llama_prompts_get_bos_once(llama):
    bos = llama.tokenizer._tok.token_to_id("<|begin_of_text|>")
    assert llama.tokenizer.encode("Hello")[0] == bos
    out = llama.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=2))[0]
    assert out.prompt_token_ids[0] == bos and out.prompt_token_ids.count(bos) == 1


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_chat_renders_the_model_template(arch, model_factory):
    llm = LLM(model_factory(arch), dtype="float32")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    rendered = llm.tokenizer.apply_chat_template(messages)
    assert "What is 2+2?" in rendered
    out = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_logprob_tokens_show_special_tokens(llama):
    # A sequence ending on EOS reports the EOS token's text in its logprobs, as OpenAI and
    # vLLM do, instead of "" (which several special tokens would share as one top_logprobs key).
    from cpud.engine.output_builder import logprob_entry

    tokenizer = llama.engine.tokenizer
    eos = tokenizer.eos_token_ids[0]
    shown = logprob_entry(llama.engine.outputs.names, eos, -0.5, 1, [eos, 5], [-0.5, -1.5])
    assert shown[eos].decoded_token == tokenizer.eos_token != ""
    assert shown[5].decoded_token == tokenizer.decode([5])
