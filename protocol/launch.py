"""What a process is started with: the resolved engine config, the specs of a rank and of the
frontend, and the names of the IPC sockets in a runtime directory.

The supervisor (or the offline `LLM`) resolves the configuration once; every child receives it
as an EngineSpec inside its spec file (msgspec JSON) and never resolves it again. The model's
facts travel too (ModelFacts: its config, and a GGUF file's tensor table; TokenizerFacts: the
tokenizer the supervisor built), so that no child parses the model's metadata again.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

Serve = TypeVar("Serve")


class TensorFacts(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor of a GGUF file lies, as its checked header says."""

    name: str
    type: int  # GGMLQuantizationType value
    dims: list[int]  # GGUF order: the row length first
    offset: int  # absolute byte offset of its data in the file
    n_bytes: int


class ModelFacts(msgspec.Struct, frozen=True):
    """The model as the supervisor read and checked it. For a GGUF file, the file's version
    (size, mtime) they describe: a process that finds another version reads the file itself."""

    config: msgspec.Raw  # cpud.model.model_config.ModelConfig as JSON
    file_size: int = 0
    file_mtime_ns: int = 0
    architecture: str | None = None  # a GGUF file's general.architecture
    tensors: list[TensorFacts] | None = None  # a GGUF file's tensors, in file order


class TokenizerFacts(msgspec.Struct, frozen=True):
    """A tokenizer built by the supervisor, as the frontend rebuilds it without the model's
    files: the `tokenizers` serialization and what the model files say around it."""

    json: str
    specials: dict[str, str | None]  # bos_token, eos_token, unk_token, pad_token
    eos_token_ids: list[int]
    chat_templates: dict[str, str]
    template_origin: str  # what a request that needs a missing one is told
    template_source: str  # how errors name them ("--chat-template", "the chat template of ...")


class EngineSpec(msgspec.Struct, frozen=True):
    """The resolved engine config (cpud.settings.config.EngineConfig without the model facts). Every
    setting is given resolved: none defaults here (cpud.settings owns the defaults)."""

    model_dir: str
    dtype: str  # torch attribute name: "bfloat16", "float16" or "float32"
    tp: int
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    num_kv_blocks: int  # exact, the same in every process
    seed: int
    kernels: str
    collective: str
    weight_cache: str | None  # directory of packed weight shards; None: off
    kv_pretouch: bool
    quantization: str
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bf16, int8, fp8, fp8_e4m3, fp8_e5m2
    speculative_config: str | None = None  # JSON (cpud.settings.speculative); None: off
    model: ModelFacts | None = None  # None: read them from model_dir


class RankSlot(msgspec.Struct, frozen=True):
    """Where one rank runs: its CPUs (one thread each) and its memory node."""

    cpus: list[int] | None  # None: no binding (nobind)
    numa_node: int | None


class RankSpec(msgspec.Struct, frozen=True):
    """One rank: where it runs, where its sockets are, and the engine it serves."""

    rank: int
    world_size: int
    runtime_dir: str
    cpus: list[int] | None  # None: no binding (nobind)
    numa_node: int | None
    collective: str  # one of cpud.settings.choices("collective")
    engine: EngineSpec


class FrontendSpec(msgspec.Struct, Generic[Serve], frozen=True):
    """The frontend of `cpud serve`: nothing secret (the API key comes on its stdin). The
    serve settings are cpud.settings.config.ServeArgs with no API key: decode as
    FrontendSpec[ServeArgs], which checks them as ServeArgs does."""

    runtime_dir: str
    engine: EngineSpec
    model_name: str  # the name served when no --served-model-name is given
    serve_args: Serve
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    tokenizer: TokenizerFacts | None = None  # None: load it from the model's files


class FrontendSecrets(msgspec.Struct, frozen=True):
    """What the supervisor writes to the frontend's stdin."""

    api_key: str | None = None

    def __repr__(self) -> str:
        return f"FrontendSecrets(api_key={'<set>' if self.api_key else None})"


def rank_spec_file(runtime_dir: str, rank: int) -> str:
    return f"{runtime_dir}/rank{rank}.json"


# A rank started with this flag imports its modules, then waits for a line on its stdin saying
# that its spec file is written (stdin closed unwritten: the start was refused).
WHEN_TOLD = "--when-told"


def frontend_spec_file(runtime_dir: str) -> str:
    return f"{runtime_dir}/frontend.json"


def plan_socket(runtime_dir: str, rank: int) -> str:
    """Where rank `rank` receives step plans (it binds; the frontend connects)."""
    return f"ipc://{runtime_dir}/rank{rank}.plans"


def results_socket(runtime_dir: str) -> str:
    """Where the ranks send step results and statistics (the frontend binds)."""
    return f"ipc://{runtime_dir}/results"
