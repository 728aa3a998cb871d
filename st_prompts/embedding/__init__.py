"""Embedding a corpus into Parquet parts, on this machine or a Ray cluster (``st-prompts embed``): :func:`embed_file`
(a file into a folder of parts, resumable) and :func:`embed_dataset` (a ``ray.data.Dataset`` gets a ``vector`` column).
"""

from st_prompts.embedding.encoder import ModelSpec
from st_prompts.embedding.ray_engine import embed_dataset
from st_prompts.embedding.run import DEFAULT_PART_ROWS, EmbedResult, RayOptions, embed_file

__all__ = ["DEFAULT_PART_ROWS", "EmbedResult", "ModelSpec", "RayOptions", "embed_dataset", "embed_file"]
