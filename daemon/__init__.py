"""cpud: a CPU-native LLM serving daemon."""

from cpud.engine.outputs import CompletionOutput, Logprob, RequestOutput
from cpud.llm import LLM
from cpud.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
