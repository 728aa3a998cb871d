"""The ``features`` keys through which callers (losses, a second pass) steer a :class:`~st_prompts.PromptedTransformer`
call, and the keys it writes (no torch import)."""

#: ``features`` key: per-row prefix attention mask, shape ``(batch, prefix_length)``, 1 = attend (see
#: :func:`~st_prompts.prompts.prefix.prefix_view_mask`). Absent = every row attends to the whole prefix.
PREFIX_ATTENTION_MASK = "prefix_attention_mask"
#: ``features`` key: one vector per row, shape ``(batch, input embedding size)``, that replaces the input embedding
#: at position 0 (the [CLS] / <s> row); it is not detached, so gradient flows into it.
CLS_OVERRIDE = "cls_override"
#: ``features`` key: explicit position ids of the real tokens, shape ``(batch, seq)``, prefix offset included.
#: Absent = computed by :meth:`PromptedTransformer.position_ids`.
POSITION_IDS = "position_ids"
#: Features key: the prefix keys/values ``(2L, batch, heads, l, head_dim)`` a pass used (written by ``forward``); given
#: back to a second pass over the same rows, they share the first pass's dropout draw.
PREFIX_VALUES = "prefix_values"
#: ``features`` key written by template tokenisation: index of the trainable vector placed at each position (-1: none).
SOFT_PROMPT_POSITIONS = "soft_prompt_positions"
#: ``features`` key: ``True``/``False`` encodes the template alone too (template denoising) for this call, whatever
#: the module's ``template_denoising``; absent = the module's setting.
TEMPLATE_DENOISING = "template_denoising"
#: ``features`` key written by ``forward`` with ``template_denoising=True``: the last hidden states of the template
#: alone (:meth:`PromptedTransformer.template_only_features`), shape ``(batch, template tokens + 2, hidden)``.
TEMPLATE_TOKEN_EMBEDDINGS = "template_token_embeddings"
#: ``features`` key written with :data:`TEMPLATE_TOKEN_EMBEDDINGS`: the ``[MASK]`` index in those template-only rows.
TEMPLATE_MASK_INDEX = "template_mask_index"
#: ``features`` key written by ``preprocess`` for a call with ``task=...`` (``encode(task=...)``): the prompt set of
#: every row (see :class:`~st_prompts.modules.prompt_sets.PromptSetsMixin`).
PROMPT_TASK = "prompt_task"
#: ``features`` key written by ``preprocess`` for inputs tagged with their own task (``encode(texts, task=[...])``):
#: one task name (or ``None``: the default) per row.
PROMPT_TASKS = "prompt_tasks"
