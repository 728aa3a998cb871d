"""D2CSE (Lee, 2022): deep prompts, an optional [CLS] prompt, and conditional replaced-token detection (CRTD) by the
same frozen encoder.

The frozen backbone carries DCPCSE's deep continuous prompts (and, per table 7, a trainable [CLS] prompt initialised
from the [CLS] embedding). Training optimises ``InfoNCE + λ · CRTD`` (:class:`~st_prompts.losses.CRTDLoss`): the
corrupted copy of each sentence (30% masked, a generator's argmax, computed once before training and cached:
:mod:`st_prompts.losses.crtd.corruption`) goes through the same prompted encoder with its [CLS] input row replaced by the
sentence vector, and a per-token ``Linear(H, 2)`` head detects the replaced tokens. DiffCSE's BatchNorm MLP pooler is
used in training only; the saved model embeds with the [CLS] output before it. Only the prompts are saved (the CRTD
head and the pooler live in the loss).

Presets: the paper's table 7 at ``scale="paper"`` (generator DistilBERT-MLM: ``distilbert-base-uncased`` for BERT,
``distilroberta-base`` for RoBERTa, which must share the backbone's vocabulary); at ``scale="cpu"`` the packaged MiniLM
with the offline fallback generator ``backbone-mlm`` (the frozen backbone with a masked-LM head trained briefly on the
training sentences) and DCPCSE's CPU budget (batch 64, one epoch), so the two compare at equal data, steps and batch.
"""
