"""The ``features`` keys through which callers (losses, a second pass) steer a :class:`~st_prompts.PromptedTransformer`
call, and the keys it writes (no torch import)."""

#: Per-row prefix attention mask ``(batch, prefix_length)``, 1 = attend (:func:`~st_prompts.prompts.prefix_view_mask`);
#: absent: every row attends to the whole prefix.
PREFIX_ATTENTION_MASK = "prefix_attention_mask"
#: One vector per row ``(batch, input embedding size)`` replacing the input embedding at position 0 (not detached).
CLS_OVERRIDE = "cls_override"
#: Explicit position ids of the real tokens ``(batch, seq)``, prefix offset included; absent: computed.
POSITION_IDS = "position_ids"
#: The prefix keys/values a pass used (written by ``forward``); given to a second pass, it shares their dropout draw.
PREFIX_VALUES = "prefix_values"
#: Written by template tokenisation: index of the trainable vector placed at each position (-1: none).
SOFT_PROMPT_POSITIONS = "soft_prompt_positions"
#: ``True``/``False`` (or one of :data:`DENOISING_POSITIONS`; ``True`` = ``"exact"``): encode the template alone too
#: for this call, whatever the module's ``template_denoising``.
TEMPLATE_DENOISING = "template_denoising"
#: Where template denoising takes the template-alone state from: ``"official"`` (as DiffAug's official ``get_delta``,
#: with a prefix draw of its own) or ``"exact"`` (each template token at its position in the full input, same draw).
DENOISING_POSITIONS = ("official", "exact")
#: Written with template denoising: the template-alone last hidden states ``(batch, template tokens + 2, hidden)``.
TEMPLATE_TOKEN_EMBEDDINGS = "template_token_embeddings"
#: Written with :data:`TEMPLATE_TOKEN_EMBEDDINGS`: the ``[MASK]`` index in those template-only rows.
TEMPLATE_MASK_INDEX = "template_mask_index"
#: Written by ``preprocess`` for ``encode(task=...)``: the prompt set of every row.
PROMPT_TASK = "prompt_task"
#: One task name (or ``None``: the default) per row, for ``encode(texts, task=[...])``.
PROMPT_TASKS = "prompt_tasks"
