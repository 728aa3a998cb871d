"""SKICSE's model, data (training rows joined with their SKI), loss and stage (settings and presets: :mod:`.config`;
SKI generation: :mod:`.generation`)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

from datasets import Dataset
from transformers import TrainerCallback

from st_prompts.data.collators import ColumnMaxLengthCollator
from st_prompts.data.training_data import load_training_dataset
from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.losses import MultiPositiveInfoNCELoss, skicse_supervised_terms, skicse_unsupervised_terms
from st_prompts.methods.base import Method, Stage, TrainSettings
from st_prompts.methods.models import assemble, plain_transformer, prompted_encoder, seed_everything
from st_prompts.methods.skicse.config import CONFIG, PRESENCE_LABEL, UNCACHED, SKICSESettings, default_ski_file
from st_prompts.methods.skicse.generation import SKICache
from st_prompts.methods.stages import head_learning_rates

logger = logging.getLogger(__name__)


def build_model(settings: SKICSESettings):
    """``full``: the trainable backbone; ``prompted``: the frozen backbone with a deep prefix. [CLS] pooling (+ the
    saved MLP head for ``mlp_head="saved"``)."""
    seed_everything(settings.seed)
    if settings.encoder == "prompted":
        return assemble(settings, prompted_encoder(settings, **settings.prefix_options()), pooling_mode="cls")
    return assemble(settings, plain_transformer(settings), pooling_mode="cls")


def ski_columns(settings: TrainSettings) -> tuple[str, ...]:
    """``(anchor, positive, ski)`` unsupervised, ``(anchor, positive, negative, ski)`` supervised (plus ``label``,
    the SKI presence flag, which is not a text column)."""
    return ("anchor", "positive", "negative", "ski") if settings.supervised else ("anchor", "positive", "ski")


def ski_loss(model, settings: SKICSESettings):
    """:class:`~st_prompts.losses.MultiPositiveInfoNCELoss` in the SKICSE configuration of the settings."""
    if settings.supervised:
        terms = skicse_supervised_terms(settings.ski_weight_1, settings.ski_weight_2, settings.reading)
    else:
        terms = skicse_unsupervised_terms(settings.ski_weight)
    return MultiPositiveInfoNCELoss(model, ski_columns(settings), terms, scale=1.0 / settings.temperature,
                                    presence_column="ski", mlp=settings.mlp_head == "train_only")


def join_ski(rows: list[tuple[str, ...]], ski: dict[str, str | None], uncached: str = "drop"
             ) -> tuple[list[tuple[str, ...]], list[str], list[int], dict[str, int]]:
    """Join training rows (the first field is the sentence / premise) with a SKI mapping.

    Returns ``(rows kept, their SKI texts ("" where missing), presence flags (1/0), counts)``; ``counts`` has
    ``rows``, ``with_ski``, ``missing`` (recorded missing, or not in the file with ``uncached="fallback"``) and
    ``dropped`` (not in the file, ``uncached="drop"``).
    """
    if uncached not in UNCACHED:
        raise ConfigurationError(f"uncached={uncached!r} is not one of {', '.join(UNCACHED)}.")
    kept = [row for row in rows if row[0] in ski or uncached != "drop"]
    texts = [ski.get(row[0]) or "" for row in kept]
    flags = [1 if text else 0 for text in texts]
    counts = {"rows": len(kept), "with_ski": sum(flags), "missing": len(kept) - sum(flags),
              "dropped": len(rows) - len(kept)}
    return kept, texts, flags, counts


def ski_data(settings: SKICSESettings, data_dir, limit: int | None):
    """The training rows of ``data_dir`` (or the hub) joined with the SKI file: columns :func:`ski_columns` + label."""
    base = load_training_dataset(settings.supervised, data_dir, limit=None, seed=settings.seed)
    text_columns = ski_columns(settings)[:-1]
    rows = list(zip(*(base[c] for c in text_columns)))
    ski_path = settings.ski_file or default_ski_file(settings.supervised)
    header, ski = SKICache(ski_path).read()
    kept, texts, flags, counts = join_ski(rows, ski, settings.uncached)
    if not kept:
        kind = "NLI premises" if settings.supervised else "sentences"
        raise DataFormatError(
            f"None of the {len(rows):,} training {kind} has a row in the SKI file {ski_path}. Generate SKI for this "
            "data with 'st-prompts ski generate --input FILE --output SKI.jsonl' and pass --ski-file SKI.jsonl, or "
            "--uncached fallback to train on every row."
        )
    order = list(range(len(kept)))
    if limit is not None and limit < len(kept):
        order = sorted(random.Random(settings.seed).sample(order, limit))
    logger.info(
        f"SKICSE data: {len(order):,} rows ({counts['with_ski']:,} with SKI and {counts['missing']:,} without, which "
        f"fall back to the SimCSE term, before --limit); {counts['dropped']:,} rows dropped as their sentence is not in "
        f"{Path(ski_path).name} (SKI by {header.get('model')})."
    )
    columns = {name: [kept[i][k] for i in order] for k, name in enumerate(text_columns)}
    columns["ski"] = [texts[i] for i in order]
    columns[PRESENCE_LABEL] = [flags[i] for i in order]
    return Dataset.from_dict(columns)


def ski_collator(model, settings: SKICSESettings):
    """Per-column token limits: ``ski_max_seq_length`` for the SKI column (capped to what the encoder allows)."""
    length = settings.ski_max_seq_length
    if length is None or length == settings.max_seq_length:
        return None
    limit = getattr(model[0], "max_position_limit", None) or model[0].auto_model.config.max_position_embeddings
    if length > limit:
        logger.warning(f"ski_max_seq_length={length} exceeds what the encoder allows; using {limit}.")
        length = limit
    return ColumnMaxLengthCollator(preprocess_fn=model.preprocess, column_max_lengths={"ski": length})


def ski_callbacks(loss, settings: SKICSESettings) -> list:
    """Log, at the end of training, how many training rows had no SKI and fell back to the SimCSE term."""
    class MissingSKILog(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            if loss.rows:
                logger.info(f"SKICSE: {loss.missing_rows:,} of {loss.rows:,} training rows seen had no SKI and used "
                            "the SimCSE term alone.")

    return [MissingSKILog()]


def stages(settings: SKICSESettings) -> list[Stage]:
    return [Stage(name="train", build_loss=ski_loss, columns=ski_columns, load_data=ski_data,
                  callbacks=ski_callbacks, learning_rates=head_learning_rates, collator=ski_collator)]


METHOD = Method(CONFIG, build_model=build_model, stages=stages)
