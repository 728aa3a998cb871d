"""Embedding a corpus into Parquet parts, on this machine or a Ray cluster (``st-prompts embed``).

* :func:`embed_file`: a text / JSON-lines / Parquet file into a folder of parts
  (:mod:`st_prompts.search.embedding_files`), resumable; ``engine="local"`` or ``"ray"``.
* :func:`embed_dataset`: a ``ray.data.Dataset`` in, the same Dataset with a ``vector`` column out (Ray Data actors).

Files: :mod:`~st_prompts.embedding.inputs` (reading an input in parts), :mod:`~st_prompts.embedding.encoder` (the model
and one part's encoding, shared by both engines), :mod:`~st_prompts.embedding.run` (the folder, resume, the local
engine), :mod:`~st_prompts.embedding.ray_engine` (Ray Data; Ray is imported only when used).
"""

from st_prompts.embedding.encoder import ModelSpec
from st_prompts.embedding.ray_engine import embed_dataset
from st_prompts.embedding.run import DEFAULT_PART_ROWS, EmbedResult, RayOptions, embed_file

__all__ = ["DEFAULT_PART_ROWS", "EmbedResult", "ModelSpec", "RayOptions", "embed_dataset", "embed_file"]
