"""What a prompt set is made of, checked in one place (no torch): :class:`PromptSetSpec` holds a deep prefix's options
and refuses, in one line, any of the wrong kind or out of range, wherever they enter (constructor, bank config,
checkpoint, command line, server). What depends on the backbone is checked by the module that holds it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from st_prompts.errors import ConfigurationError, shorten
from st_prompts.numbers import real, whole

__all__ = ["MAX_PREFIX_HIDDEN_SIZE", "MAX_PREFIX_LENGTH", "SAVED_FIELDS", "SPEC_FIELDS", "PromptSetSpec"]

#: The longest prefix any set may have, whatever the backbone (a backbone without a position table included).
MAX_PREFIX_LENGTH = 16_384
#: The largest hidden size of a prefix's reparameterisation MLP.
MAX_PREFIX_HIDDEN_SIZE = 65_536
#: The options of a set (the fields of :class:`PromptSetSpec`), as a bank's config may list them.
SPEC_FIELDS = ("prefix_length", "prefix_projection", "prefix_hidden_size", "prefix_dropout", "prefix_gate",
               "init_std")
#: The options a bank's config records per set (the initialisation is not part of a trained set).
SAVED_FIELDS = SPEC_FIELDS[:-1]


@dataclass(frozen=True)
class PromptSetSpec:
    """The options of one prompt set, checked when it is made (:meth:`check`).

    Attributes:
        prefix_length: positions of the prefix, 1 to :data:`MAX_PREFIX_LENGTH`.
        prefix_projection: reparameterise the prefix with ``Embedding -> Linear -> Tanh -> Linear`` while training.
        prefix_hidden_size: that MLP's hidden size, 1 to :data:`MAX_PREFIX_HIDDEN_SIZE`, or ``None`` (the backbone's).
        prefix_dropout: dropout on the prefix in training, in ``[0, 1)``, or ``None`` (the backbone's).
        prefix_gate: reach attention through a zero-initialised gate (the untrained set encodes as the backbone).
        init_std: std of the prefix's normal initialisation, positive, or ``None`` (the backbone's
            ``initializer_range``).
    """

    prefix_length: int = 16
    prefix_projection: bool = False
    prefix_hidden_size: int | None = None
    prefix_dropout: float | None = None
    prefix_gate: bool = False
    init_std: float | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self, where: str = "a prompt set") -> None:
        """Refuse options of the wrong kind or out of range, one line naming ``where`` and the option."""
        if not whole(self.prefix_length) or not 1 <= self.prefix_length <= MAX_PREFIX_LENGTH:
            raise ConfigurationError(f"{where}: prefix_length must be a whole number from 1 to {MAX_PREFIX_LENGTH}, "
                                     f"got {shorten(self.prefix_length)}.")
        if self.prefix_hidden_size is not None and (not whole(self.prefix_hidden_size)
                                                    or not 1 <= self.prefix_hidden_size <= MAX_PREFIX_HIDDEN_SIZE):
            raise ConfigurationError(f"{where}: prefix_hidden_size must be a whole number from 1 to "
                                     f"{MAX_PREFIX_HIDDEN_SIZE} (or none: the backbone's hidden size), got "
                                     f"{shorten(self.prefix_hidden_size)}.")
        if self.prefix_dropout is not None and (not real(self.prefix_dropout)
                                                or not 0.0 <= self.prefix_dropout < 1.0):
            raise ConfigurationError(f"{where}: prefix_dropout must be a number in [0, 1) (or none: the backbone's "
                                     f"hidden dropout), got {shorten(self.prefix_dropout)}.")
        if self.init_std is not None and (not real(self.init_std) or not self.init_std > 0):
            raise ConfigurationError(f"{where}: init_std (prefix_init_std) must be a positive number (or none: "
                                     f"the backbone's initializer_range), got {shorten(self.init_std)}.")
        for name in ("prefix_projection", "prefix_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{where}: {name} must be true or false, got {shorten(getattr(self, name))}.")

    @classmethod
    def from_config(cls, raw: Any, where: str = "a prompt set") -> PromptSetSpec:
        """The spec of a set as a saved config lists it (an object of :data:`SPEC_FIELDS`; ``null`` flags are
        false), refused in one line naming ``where`` if it is not one."""
        if not isinstance(raw, dict):
            raise ConfigurationError(f"{where}: its options must be an object, got {type(raw).__name__}.")
        unknown = sorted(shorten(key) for key in raw if key not in SPEC_FIELDS)
        if unknown:
            raise ConfigurationError(f"{where}: unknown option(s) {', '.join(unknown[:5])} (known: "
                                     f"{', '.join(SPEC_FIELDS)}).")
        if "prefix_length" not in raw:
            raise ConfigurationError(f"{where}: prefix_length is missing.")
        spec = object.__new__(cls)  # checked below with ``where`` in the message, not by __post_init__
        for name in SPEC_FIELDS:
            value = raw.get(name, getattr(cls, name))
            is_flag = name in ("prefix_projection", "prefix_gate")
            object.__setattr__(spec, name, False if is_flag and value is None else value)
        spec.check(where)
        return spec

    def saved(self) -> dict[str, Any]:
        """What a bank's config records of the set (:data:`SAVED_FIELDS`)."""
        return {key: value for key, value in asdict(self).items() if key in SAVED_FIELDS}
