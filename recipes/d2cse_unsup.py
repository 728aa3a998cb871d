"""D2CSE, unsupervised: deep prompts on a frozen backbone, InfoNCE + 0.005 x conditional replaced-token detection.

Each Wikipedia sentence is paired with itself (dropout views). Before training, every sentence is corrupted once and
cached: 30% of its tokens are masked and a generator's argmax fills them. The corrupted copy goes through the same
prompted encoder with its [CLS] input row replaced by the sentence vector, and a Linear(H, 2) head detects the
replaced tokens. DiffCSE's BatchNorm MLP pooler in training only; the saved model embeds with [CLS] before it.

--scale paper (D2CSE table 7: masking ratio 0.3, lambda 0.005, 2 epochs; generator DistilBERT-MLM):
    bert-base-uncased   batch 144, lr 0.021, prompt length 16, no [CLS] prompt, generator distilbert-base-uncased
    bert-large-uncased  batch 144, lr 0.034, prompt length 16, no [CLS] prompt, generator distilbert-base-uncased
    roberta-base        batch 128, lr 0.044, prompt length 16, [CLS] prompt,    generator distilroberta-base
--scale cpu (default): packaged all-MiniLM-L6-v2 with DCPCSE's CPU budget (batch 64, prefix 16, 1 epoch; lr 3e-2),
no [CLS] prompt, and the offline fallback generator backbone-mlm (the frozen backbone with an MLM head trained
briefly on the training sentences; its held-out masked-token accuracy is reported in train_result.json).
Model selection: STS-B dev every 125 (paper) / 50 (cpu) steps.

    python recipes/d2cse_unsup.py --data-dir ../shared/data
    python recipes/d2cse_unsup.py --data-dir ../shared/data --cls-prompt          # the [CLS] prompt ablation
    python recipes/d2cse_unsup.py --scale paper --senteval-dir ../shared/data/senteval
"""

from _common import main

if __name__ == "__main__":
    main("d2cse", supervised=False, description=__doc__)
