"""DiffAug (Wang & Lu, 2022): two prefixes as a differentiable data augmentation, trained in two stages.

What the official code (TianduoWang/DiffAug) does is the default here; each other choice is an option.

* **Two prefixes, one encoder.** One reparameterised prefix of ``2l`` positions (``Embedding(2l, H) → Linear(H, H)
  → Tanh → Linear(H, 2·L·H)``, initialised N(0, ``initializer_range``) like every weight the official
  ``init_weights()`` creates): the anchor attends to the first half (``θ1``), the positive and the hard negative to
  the second (``θ2``), every row attends to all ``2l`` at inference. The views are made by the per-row prefix
  attention mask, so positions never shift. ``--same-prefix`` (the paper's "same" ablation) uses one prefix of ``l``
  positions for both sentences.
* **PromptBERT template.** The hard template ``This sentence of "[X]" means [MASK].`` and [MASK] pooling. Template
  denoising (the template-only [MASK] state, same positions, subtracted) is used inside the stage-2 contrastive loss
  only, as in the official code ("for contrastive learning"): not in stage 1, not on the auxiliary NLI rows, not in
  STS-B dev selection and not at inference (``--inference-denoising`` keeps it there). ``--pooling cls`` (or
  ``mean``) drops the template and pools the last layer (the official ``apply_prompt=False``), for backbones whose
  [MASK] state carries little (all-MiniLM-L6-v2 has no MLM head: ``benchmarks/results/diffaug_probe.md``).
* **The training-only MLP** (official ``--mlp_train``): ``Linear(H, H) + Tanh`` over the pooled output, applied to
  the classifier's features in stage 1 (frozen at its random initialisation: not in stage 1's optimiser) and to the
  contrastive and NLI features in stage 2 (trained); never applied at evaluation, never saved.
* **Stage 1: prefix tuning on NLI.** The backbone is frozen; the prefix and a ``Linear(3H, 2)`` classifier over
  ``(u, v, |u − v|)`` train on NLI *triplets*: each premise is encoded once with view 0, its entailment and
  contradiction with view 1, so a batch of 128 triplets gives 256 classifier rows (entailment 1, contradiction 0).
  The learning rate decays linearly over the *stage-2* length, as the official scheduler does, and stage 1 stops
  after ``--stage1-steps`` (so it ends well above 0; ``--stage1-schedule stage1`` decays to 0 within stage 1).
  δ and κ are logged (:mod:`.diagnostics`); with ``--stage1-switch diagnostics`` stage 1 ends
  once δ has peaked and κ < ``--kappa-threshold`` (the paper's rule; the official code has no δ/κ).
* **Stage 2: joint contrastive tuning.** Backbone, prefix, MLP (and classifier) train together, the backbone at
  ``--backbone-learning-rate``. Semi-supervised: unlabelled sentences, the two views of a sentence are the positive
  pair, plus (``--aux-weight``, paper 1e-3) the NLI cross-entropy over triplets with the stage-1 classifier.
  Supervised: NLI triplets (premise view 0, entailment and contradiction view 1); the official script accumulates 4
  batches of 128 (``--gradient-accumulation-steps 4`` at ``--scale paper``; the paper's table 5 reads 128: pass
  ``--gradient-accumulation-steps 1``). STS-B dev selects the best step and restores every weight that trains, the
  backbone included.

Since the backbone changes, a DiffAug model is always saved in full (``prompts_only=False``). The stage-1 result is
saved beside the output as a prompts-only checkpoint with its classifier and MLP (``OUTPUT-stage1``: its backbone is
still the original); ``--stage1-from DIR`` starts stage 2 from such a checkpoint (refused for another backbone),
``--skip-stage1`` runs stage 2 from a random prefix (the paper's "no stage 1" ablation).

Presets: table 5 of the paper and the official scripts at ``scale="paper"`` (BERT-base, l = 8); the packaged MiniLM
on the shared data at ``scale="cpu"``.
"""
