"""How big a prompt set is: what training updates and what a checkpoint stores, two different numbers.

A plain deep prefix trains and stores the same ``l · 2L · H`` numbers (plus its gate). A reparameterised one
(``prefix_projection=True``: an embedding table fed through an MLP) trains the table and the MLP, far more numbers
(2,567,168 for a 16-position MiniLM prefix with a 512-wide MLP), but is stored as the prefix the MLP computes
(:meth:`~st_prompts.prompts.PrefixEncoder.stored_state_dict`: 73,728 numbers, 295 KB): comparisons with other
methods at equal *size* use the stored count, comparisons of training cost the trainable one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["PromptSize", "prompt_set_size", "prompt_sizes"]


@dataclass(frozen=True)
class PromptSize:
    """The sizes of one prompt set (a :class:`~st_prompts.prompts.PrefixEncoder`).

    Attributes:
        trainable_parameters: numbers training updates (the embedding table, the MLP when reparameterised, the gate).
        stored_parameters: numbers a checkpoint stores (the computed prefix and the gate).
        stored_bytes: bytes of those numbers in the checkpoint's ``soft_prompts.safetensors`` (headers aside).
    """

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
