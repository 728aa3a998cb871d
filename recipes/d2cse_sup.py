"""D2CSE, supervised: deep prompts and a [CLS] prompt on a frozen backbone, NLI triplets, InfoNCE + 0.005 x CRTD.

(premise, entailment, contradiction) triplets; the contradiction is an in-batch hard negative of InfoNCE (tau =
0.05). Conditional replaced-token detection runs on all three sentences, each conditioned on its own vector
(sum over i in {anchor, positive, negative} of L_CRTD(x^i, x_g^i, h^i, f)). The corruption (30% masked, generator
argmax) is computed once before training and cached. Pooler: DiffCSE's BatchNorm MLP in training only.

--scale paper (D2CSE table 7: masking ratio 0.3, lambda 0.005, 10 epochs, [CLS] prompt; generator DistilBERT-MLM):
    bert-base-uncased  batch 256, lr 0.055, prompt length 12, generator distilbert-base-uncased
    roberta-base       batch 256, lr 0.024, prompt length 12, generator distilroberta-base
--scale cpu (default): packaged all-MiniLM-L6-v2 with DCPCSE's CPU budget (batch 64, lr 3e-2, prefix 12, 1 epoch over
the SNLI triplets), [CLS] prompt, offline fallback generator backbone-mlm.

    python recipes/d2cse_sup.py --data-dir ../shared/data
    python recipes/d2cse_sup.py --data-dir ../shared/data --no-cls-prompt       # the [CLS] prompt ablation
"""

from _common import main

if __name__ == "__main__":
    main("d2cse", supervised=True, description=__doc__)
