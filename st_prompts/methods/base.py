"""What a method is: settings with paper/CPU presets, a model builder, and a list of training stages (the registry:
:mod:`st_prompts.methods`). Shared code reads the registry, so adding a method adds no branch to it. No torch here:
the command line lists the methods and their options from the ``config.py`` files alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from st_prompts.errors import ConfigurationError
from st_prompts.prompts.spec import PromptSetSpec
from st_prompts.utils import check_finite

#: ``--scale`` values: ``paper`` (hub backbone, the paper's hyperparameters), ``cpu`` (packaged MiniLM, minutes).
SCALES = ("paper", "cpu")
#: Options of the SimCSE MLP over the sentence embedding (``Linear(H, H) + Tanh``):
#: ``train_only`` — applied in training, dropped at inference (SimCSE/DCPCSE ``--mlp_only_train``, unsupervised);
#: ``saved`` — a real module of the saved model, applied in training and at inference (official supervised runs);
#: ``none`` — no MLP.
MLP_HEAD_MODES = ("train_only", "saved", "none")


def option(default: Any, help: str, choices: Sequence[Any] | None = None, cli: bool = True) -> Any:
    """A settings field with its command-line help (and choices); ``cli=False`` keeps it off the command line."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "cli": cli}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainSettings:
    """The options every method shares. Method files subclass it with their own fields (use :func:`option`)."""

    method: str = option("", "method name (set by the registry)", cli=False)
    supervised: bool = option(False, "supervised NLI training (default: unsupervised)", cli=False)
    #: which preset table fills the unset options: "paper" (the paper's) or "cpu" (the packaged MiniLM on two cores).
    #: A preset, not a device: training runs wherever torch puts the model either way.
    scale: str = option("paper", "preset scale", SCALES, cli=False)
    backbone: str = option("bert-base-uncased", "backbone name, path or alias ('minilm')")
    learning_rate: float = option(3e-5, "peak learning rate (linear decay)")
    batch_size: int = option(64, "training batch size (in-batch negatives)")
    epochs: float = option(1.0, "training epochs")
    gradient_accumulation_steps: int = option(1, "optimizer step every this many batches (in-batch negatives stay "
                                              "those of one batch)")
    max_steps: int = option(-1, "stop after this many optimisation steps (-1: run the epochs)")
    max_seq_length: int = option(32, "maximum tokens per sentence in training (the training length; the saved model "
                                 "encodes up to --max-encode-length)")
    max_encode_length: int | None = option(None, "most tokens per text the saved model encodes (default: the "
                                           "backbone's own limit, e.g. 256 for all-MiniLM-L6-v2, 512 for BERT, less "
                                           "the prefix)")
    temperature: float = option(0.05, "InfoNCE temperature tau")
    eval_steps: int = option(125, "evaluate STS-B dev every this many steps (model selection)")
    warmup_ratio: float = option(0.0, "share of the steps with a linear warm-up")
    seed: int = option(42, "random seed (prompt initialisation, data order, dropout)")
    output_dir: str = option("outputs/run", "where the trained model is saved (trainer files go to a temporary "
                             "folder)", cli=False)
    logging_steps: int = option(10, "log the loss every this many steps")
    gradient_checkpointing: bool = option(False, "activation checkpointing: recompute each layer in the backward pass "
                                          "(less training memory, more time)")
    trust_remote_code: bool = option(False, "let the backbone (and a generator or LLM the method loads) run code that "
                                     "ships with it or load pickled weights; without it such a backbone is refused "
                                     "before anything of it runs. Only for backbones whose code you trust")

    def __post_init__(self) -> None:
        # Every number of every method's settings (learning rates, temperatures, weights, ratios, ...): NaN and
        # infinities are refused before anything else reads them.
        check_finite(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.batch_size < 2:
            raise ConfigurationError("In-batch negatives need batch_size >= 2.")
        if self.max_steps != -1 and self.max_steps < 1:
            raise ConfigurationError(f"max_steps must be a positive number of steps (or -1 to run the epochs), got "
                                     f"{self.max_steps}.")
        if self.max_steps == -1 and not self.epochs > 0:
            raise ConfigurationError(f"epochs must be positive, got {self.epochs}.")
        for name in ("eval_steps", "logging_steps", "max_seq_length", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.max_encode_length is not None and self.max_encode_length < 2:
            raise ConfigurationError(f"max_encode_length must be at least 2 tokens, got {self.max_encode_length}.")
        if not self.learning_rate > 0:
            raise ConfigurationError(f"learning_rate must be positive, got {self.learning_rate}.")
        if self.scale not in SCALES:
            raise ConfigurationError(f"Unknown scale {self.scale!r}; choose one of {', '.join(SCALES)}.")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigurationError(
                    f"{f.name}={getattr(self, f.name)!r} is not one of {', '.join(map(str, choices))}."
                )

    def replace(self, **changes: Any) -> TrainSettings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass
class PrefixSettings(TrainSettings):
    """The options of a method with a deep prefix (DCPCSE, D2CSE, DiffAug, SKICSE's prompted encoder)."""

    prefix_length: int = option(16, "deep prompt positions per layer")
    prefix_projection: bool = option(False, "reparameterise the prefix with an MLP (Embedding -> Linear -> Tanh -> Linear)")
    prefix_hidden_size: int | None = option(512, "hidden size of that reparameterisation MLP (none: the backbone's "
                                            "hidden size)")
    prefix_init_std: float | None = option(None, "std of the prefix's normal initialisation, biases zero (default: "
                                           "the backbone's initializer_range, 0.02 for BERT, as in the official code)")
    prefix_gate: bool = option(False, "reach attention through a zero-initialised gate per layer and head (LLaMA-"
                               "Adapter): the untrained model is exactly its backbone; off = the official prefix")

    def __post_init__(self) -> None:
        super().__post_init__()
        # the one spec of a prompt set checks the prefix's options (kinds and ranges)
        PromptSetSpec.from_config({"prefix_length": self.prefix_length, "prefix_projection": self.prefix_projection,
                                   "prefix_hidden_size": self.prefix_hidden_size, "init_std": self.prefix_init_std,
                                   "prefix_gate": self.prefix_gate}, "the method's settings")

    def prefix_options(self) -> dict[str, Any]:
        """The prefix's keyword arguments of :class:`~st_prompts.PromptedTransformer`."""
        options = dict(prefix_length=self.prefix_length, prefix_projection=self.prefix_projection,
                       prefix_hidden_size=self.prefix_hidden_size, prefix_init_std=self.prefix_init_std)
        if self.prefix_gate:
            options["prefix_gate"] = True
        return options


@dataclass(frozen=True)
class Stage:
    """One training stage: what trains, with which loss, on which data.

    Attributes:
        name: shown in logs and used to key per-stage datasets (``train(settings, {"stage1": ds1, ...})``).
        build_loss: ``(model, settings) -> loss module``; training-only heads live in the loss.
        columns: ``settings -> column names`` the stage's dataset must have, in order.
        load_data: ``(settings, data_dir, limit) -> datasets.Dataset`` (``data_dir=None``: hub or bundled data).
        prepare: ``(model, settings) -> None`` run before the stage (e.g. freeze or unfreeze the backbone).
        callbacks: ``(loss, settings) -> list`` of trainer callbacks for the stage.
        learning_rates: ``(model, settings) -> {regex over the loss's parameter names: lr}``
            (sentence-transformers' ``learning_rate_mapping``).
        max_steps, learning_rate, batch_size, epochs, gradient_accumulation: ``settings -> value`` of this stage
            (``None``: the settings' ``max_steps``, ``learning_rate``, ... ``gradient_accumulation_steps``).
        select_model: evaluate on STS-B dev during this stage and keep the best weights.
        collator: ``(model, settings) -> data collator`` (default: sentence-transformers' own).
        prepare_loss: ``(loss, dataset, settings) -> report dict | None``: a pre-pass over the stage's training data
            whose result the loss needs (D2CSE's corruption), run once before the stage trains; its report lands in
            ``TrainResult.stage_reports[stage name]``.
        schedule_steps: ``(settings, datasets by stage name) -> steps`` the linear schedule decays over, when that
            differs from the steps trained (DiffAug's official stage 1 decays over the stage-2 length, stops before).
    """

    name: str
    build_loss: Callable[[Any, TrainSettings], Any]
    columns: Callable[[TrainSettings], tuple[str, ...]]
    load_data: Callable[[TrainSettings, Any, int | None], Any]
    prepare: Callable[[Any, TrainSettings], None] | None = None
    callbacks: Callable[[Any, TrainSettings], list] | None = None
    learning_rates: Callable[[Any, TrainSettings], dict[str, float]] | None = None
    max_steps: Callable[[TrainSettings], int | None] | None = None
    select_model: bool = True
    collator: Callable[[Any, TrainSettings], Any] | None = None
    prepare_loss: Callable[[Any, Any, TrainSettings], dict[str, Any] | None] | None = None
    learning_rate: Callable[[TrainSettings], float] | None = None
    batch_size: Callable[[TrainSettings], int] | None = None
    epochs: Callable[[TrainSettings], float] | None = None
    schedule_steps: Callable[[TrainSettings, dict[str, Any]], int] | None = None
    gradient_accumulation: Callable[[TrainSettings], int] | None = None


#: ``MethodConfig.supervision`` values: the first two name the setting without labelled pairs.
SUPERVISION = ("unsupervised", "semi-supervised", "supervised")


@dataclass(frozen=True)
class MethodConfig:
    """What is known about a method without importing torch (its ``config.py``; all that ``--help`` reads).

    Attributes:
        name: the registry key (``st-prompts train <name>``).
        summary: one line for ``--help``.
        settings_class: the :class:`TrainSettings` subclass holding the method's options.
        presets: ``(scale, supervised, backbone or None) -> {field: value}``: the paper's table for ``"paper"``, the
            packaged MiniLM's setting for ``"cpu"``.
        supervision: the settings the method has: ``"unsupervised"`` (or DiffAug's ``"semi-supervised"``) and/or
            ``"supervised"``.
        prompts_only: whether a trained model can be saved as a prompts-only checkpoint (backbone unchanged).
        side_outputs: ``settings -> ((suffix, kind), ...)``: folders a run writes beside its output and the kind their
            manifests record, checked before training like the output itself.
        quick: settings that make a smoke run take seconds (``benchmarks/run_all --quick``).
        last_stage_alone: settings under which the last stage runs alone, its preparation kept short
            (``benchmarks/efficiency.py`` times it): e.g. DiffAug's stage 2 without stage 1.
        title: the method's name as written (``"DiffAug"``); default the name in capitals.
        citation: who and when, short (``"Wang & Lu 2022"``), for the methods table.
        paper, paper_url: the paper's full title and link, cited by the model card of every model it trains.
        description: one line for the methods table (:mod:`st_prompts.methods.catalog`).
    """

    name: str
    summary: str
    settings_class: type[TrainSettings]
    presets: Callable[[str, bool, str | None], dict[str, Any]]
    supervision: tuple[str, ...] = ("unsupervised", "supervised")
    prompts_only: bool = True
    side_outputs: Callable[[TrainSettings], tuple[tuple[str, str], ...]] = lambda settings: ()
    quick: tuple[tuple[str, Any], ...] = ()
    last_stage_alone: tuple[tuple[str, Any], ...] = ()
    title: str = ""
    citation: str = ""
    paper: str | None = None
    paper_url: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not self.title:
            object.__setattr__(self, "title", self.name.upper())
        unknown = [s for s in self.supervision if s not in SUPERVISION]
        if unknown or not self.supervision or len(set(self.supervision) - {"supervised"}) > 1:
            raise ConfigurationError(f"supervision must name some of {', '.join(SUPERVISION)} (one setting without "
                                     f"labelled pairs at most), got {self.supervision}.")

    def setting_name(self, supervised: bool) -> str | None:
        """The name of the method's supervised (``True``) or other (``False``) setting; ``None`` if it has none."""
        names = [s for s in self.supervision if (s == "supervised") == bool(supervised)]
        return names[0] if names else None

    def supports(self, supervised: bool) -> bool:
        """Whether the method has the supervised (``True``) or the unsupervised / semi-supervised setting."""
        return self.setting_name(supervised) is not None

    def settings(self, supervised: bool = False, scale: str = "paper", backbone: str | None = None,
                 **overrides: Any) -> TrainSettings:
        """The settings of a run: the preset for (scale, supervision, backbone), then ``overrides`` (``None`` values
        are ignored, so parsed command-line options can be passed as they are)."""
        if scale not in SCALES:
            raise ConfigurationError(f"Unknown scale {scale!r}; choose one of {', '.join(SCALES)}.")
        if not self.supports(supervised):
            raise ConfigurationError(f"{self.name} has no {'supervised' if supervised else 'unsupervised'} setting.")
        values: dict[str, Any] = {"method": self.name, "supervised": supervised, "scale": scale}
        values.update(self.presets(scale, supervised, backbone))
        if backbone is not None:
            values["backbone"] = backbone
        known = {f.name for f in dataclasses.fields(self.settings_class)}
        unknown = sorted(k for k, v in overrides.items() if v is not None and k not in known)
        if unknown:
            raise ConfigurationError(f"{self.name} has no option(s) {', '.join(unknown)}; options: {', '.join(sorted(known))}.")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return self.settings_class(**values)


@dataclass(frozen=True)
class Method:
    """A registered method (see :mod:`st_prompts.methods`): its :class:`MethodConfig` and how to build and train it.

    Lives in the method's ``method.py`` (which may import torch).

    Attributes:
        config: the light part (settings, presets, what the method supports).
        build_model: ``settings -> SentenceTransformer`` (the model that is trained and saved).
        stages: ``settings -> [Stage, ...]``; a two-stage method is just a longer list.
    """

    config: MethodConfig
    build_model: Callable[[TrainSettings], Any]
    stages: Callable[[TrainSettings], list[Stage]]

    # the config's, read through the method
    name = property(lambda self: self.config.name)
    summary = property(lambda self: self.config.summary)
    settings_class = property(lambda self: self.config.settings_class)
    prompts_only = property(lambda self: self.config.prompts_only)
    side_outputs = property(lambda self: self.config.side_outputs)
    settings = property(lambda self: self.config.settings)  # MethodConfig.settings, bound to the config


def cli_fields(settings_class: type[TrainSettings]) -> list[dataclasses.Field]:
    """The settings fields exposed on the command line (``--field-name``), in declaration order."""
    return [f for f in dataclasses.fields(settings_class) if f.metadata.get("cli", True)]
