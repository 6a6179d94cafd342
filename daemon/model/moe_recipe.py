"""What a mixture-of-experts layer computes beyond its shapes: the router, the expert biases
and the gated activation. Families set it (ModelConfig.moe); the torch reference
(ranks/layers/moe.py) and the native kernel (native/drivers/moe.c) both follow it."""

from __future__ import annotations

from dataclasses import dataclass

from cpud.settings.errors import ConfigError

ROUTERS = ("softmax_topk", "topk_softmax")
ACTIVATIONS = ("silu", "swiglu_oai")


@dataclass(frozen=True)
class MoeRecipe:
    """router: "softmax_topk" (softmax over all experts in fp32, then the top k; Qwen, Mixtral)
    or "topk_softmax" (top k of the raw logits, softmax over those k; gpt-oss).
    renormalize: the softmax_topk weights divided by their sum over the k.
    weights_in_dtype: routing weights rounded to the model dtype before they scale the experts'
    outputs (else fp32 until then).
    router_bias: the router linear has a bias. expert_bias: each expert's gate_up has a bias
    [2 I] (gate rows first, then up) and its down one [H].
    activation: "silu" (silu(g) * u) or "swiglu_oai" (g = min(g, limit),
    u = clamp(u, -limit, limit), (u + 1) * g * sigmoid(alpha * g))."""

    router: str = "softmax_topk"
    renormalize: bool = False
    weights_in_dtype: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ConfigError(f"MoE router {self.router!r} is not one of {', '.join(ROUTERS)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"MoE activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}"
            )
        if not self.swiglu_limit > 0:
            raise ConfigError(f"MoE swiglu_limit must be positive, got {self.swiglu_limit}")
