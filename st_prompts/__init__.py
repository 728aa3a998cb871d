"""st_prompts: prompt-based, parameter-efficient contrastive sentence embeddings for sentence-transformers."""

__version__ = "0.1.0"
