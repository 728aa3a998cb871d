"""Data collators for the runner's stages (``Stage.collator``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sentence_transformers.sentence_transformer.data_collator import SentenceTransformerDataCollator


@dataclass
class ColumnMaxLengthCollator(SentenceTransformerDataCollator):
    """sentence-transformers' collator with a maximum token length per column (``column_max_lengths``, e.g.
    ``{"ski": 96}`` for SKICSE's paragraphs); other columns keep the model's ``max_seq_length``. Each column is
    tokenised by the stock collator with its own ``max_length``, and the columns keep their dataset order."""

    column_max_lengths: dict[str, int] = field(default_factory=dict)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features or not self.column_max_lengths:
            return super().__call__(features)
        label_columns = [c for c in features[0] if c in self.valid_label_columns or c == "dataset_name"]
        text_columns = [c for c in features[0] if c not in label_columns]
        # the column-order check belongs to the whole row, once: the one-column collators below would warn every batch
        names = tuple(c for c in features[0] if c != "dataset_name")
        warned = getattr(self, "_warned_columns", None)
        if warned is not None and names not in warned:
            self.maybe_warn_about_column_order(list(names))
            warned.add(names)
        batch: dict[str, Any] = {}
        for column in text_columns:
            plain = replace(self, column_max_lengths={}, max_length=self.column_max_lengths.get(column))
            if warned is not None:
                plain._warned_columns.add((column, *(c for c in label_columns if c != "dataset_name")))
            rows = [{column: row[column], **{c: row[c] for c in label_columns}} for row in features]
            part = SentenceTransformerDataCollator.__call__(plain, rows)
            for key, value in part.items():
                if key.startswith(f"{column}_") or key not in batch:
                    batch[key] = value
        return batch
