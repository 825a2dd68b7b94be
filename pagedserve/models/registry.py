"""Maps Hugging Face ``architectures[0]`` names to our model classes (a dict, never an if/elif chain)."""

from __future__ import annotations

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM


class ModelLoadError(RuntimeError):
    """A model cannot be found, read or built; the message says what to do about it."""


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """The class for the first supported name in a config's ``architectures`` list."""
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ModelLoadError(
        f"unsupported model architecture {architectures}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
