"""Exceptions raised by st_prompts for user errors (bad input, missing files, mismatched checkpoints).

All of them derive from :class:`StPromptsError`, which the CLI prints as a one-line message instead of a traceback.
They also derive from the built-in exception a Python user would expect (``ValueError`` or ``FileNotFoundError``).
"""


class StPromptsError(Exception):
    """Base class of every error st_prompts raises on purpose."""


class ConfigurationError(StPromptsError, ValueError):
    """An invalid option or an unsupported combination of options (e.g. ``prefix_length=0``)."""


class UnsupportedArchitectureError(StPromptsError, ValueError):
    """The backbone cannot carry deep prompts (it does not accept, or silently ignores, a key/value cache)."""


class BackboneMismatchError(StPromptsError, ValueError):
    """Weights or a model do not match what a saved artefact was made with: a prompts-only checkpoint put on a
    backbone whose weights differ from the one its prompts were trained on, or a search index queried with a model
    (or dimension) other than the one that encoded its corpus."""


class DataFormatError(StPromptsError, ValueError):
    """A data file or directory is missing pieces or has the wrong format (e.g. a SentEval directory)."""


class DataNotFoundError(StPromptsError, FileNotFoundError):
    """A file or directory the user pointed to does not exist."""


class UntrustedCodeError(StPromptsError, ValueError):
    """A model needs code from outside sentence-transformers and st_prompts (a foreign class in its ``modules.json``,
    or custom modelling code in a ``config.json``), it was loaded without ``trust_remote_code``, and
    sentence-transformers or transformers refused to import that code. Pass ``--trust-remote-code`` (or
    ``trust_remote_code=True``) only for a model whose code you trust."""


class SKICacheMismatchError(StPromptsError, ValueError):
    """A SKI cache file was generated with another model, prompt template or generation settings than the run that
    would extend (or read) it: its rows must not be mixed with new ones."""


class VocabularyMismatchError(StPromptsError, ValueError):
    """A model that must share the encoder's vocabulary does not: e.g. a replaced-token generator whose tokenizer maps
    tokens to other ids than the encoder's (replaced-token detection compares token ids position by position)."""


class CorruptionCacheError(StPromptsError, ValueError):
    """A replaced-token corruption cache does not fit the run: it was made with another generator, masking ratio or
    tokenizer, or a training sentence has no corrupted copy in it (the pre-pass was not run over the training data)."""
