"""How big a prompt set is: a reparameterised prefix (an embedding table fed through an MLP) trains far more numbers
than it stores; comparisons at equal *size* use the stored count, comparisons of training cost the trainable one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PromptSize", "prompt_set_size", "prompt_sizes"]


@dataclass(frozen=True)
class PromptSize:
    """The sizes of one prompt set: numbers training updates, numbers a checkpoint stores, and their bytes."""

    trainable_parameters: int
    stored_parameters: int
    stored_bytes: int

    def as_dict(self) -> dict[str, int]:
        """The three numbers as a dict (what ``st-prompts bank list --json`` prints)."""
        return asdict(self)


def prompt_set_size(encoder: Any) -> PromptSize:
    """:class:`PromptSize` of a prefix encoder (:class:`~st_prompts.prompts.PrefixEncoder`)."""
    stored = encoder.stored_parameter_count()  # counted, not computed: no MLP pass
    return PromptSize(trainable_parameters=encoder.trainable_parameter_count(), stored_parameters=stored,
                      stored_bytes=stored * encoder.embedding.weight.element_size())


def prompt_sizes(module: Any) -> dict[str, PromptSize]:
    """Every prefix of a :class:`~st_prompts.PromptedTransformer`: its prompt sets by name, and its own prefix under
    ``""`` when it has one."""
    sizes = {"": prompt_set_size(module.prefix_encoder)} if getattr(module, "prefix_encoder", None) is not None else {}
    sizes.update({name: prompt_set_size(encoder) for name, encoder in module.prompt_sets.items()})
    return sizes
