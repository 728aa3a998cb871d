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
#: the module's ``template_denoising``; absent = the module's setting. A value of :data:`DENOISING_POSITIONS` also
#: says where the template-alone state is taken (``True`` = ``"exact"``).
TEMPLATE_DENOISING = "template_denoising"
#: Where template denoising takes the template-alone state from:
#: ``"official"`` — as DiffAug's official ``get_delta``: the template tokens after the sentence slot sit as many
#: positions further as the row attends prefix positions (its index, ``attention_mask.sum() - template length``, counts
#: the prefix-mask ones), with a prefix draw of its own;
#: ``"exact"`` — every template token at the position it has in the full input, with the full pass's prefix draw.
DENOISING_POSITIONS = ("official", "exact")
#: ``features`` key written by ``forward`` with ``template_denoising=True``: the last hidden states of the template
#: alone (:meth:`PromptedTransformer.template_only_features`), shape ``(batch, template tokens + 2, hidden)``.
TEMPLATE_TOKEN_EMBEDDINGS = "template_token_embeddings"
#: ``features`` key written with :data:`TEMPLATE_TOKEN_EMBEDDINGS`: the ``[MASK]`` index in those template-only rows.
TEMPLATE_MASK_INDEX = "template_mask_index"
#: ``features`` key written by ``preprocess`` for a call with ``task=...`` (``encode(task=...)``): the prompt set of
#: every row (see :class:`~st_prompts.modules.prompt_sets.PromptSets`).
PROMPT_TASK = "prompt_task"
#: ``features`` key written by ``preprocess`` for inputs tagged with their own task (``encode(texts, task=[...])``):
#: one task name (or ``None``: the default) per row.
PROMPT_TASKS = "prompt_tasks"
