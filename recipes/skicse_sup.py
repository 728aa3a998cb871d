"""SKICSE, supervised: NLI (premise x, entailment x+, contradiction x-) and the SKI of the premise x_ski.

Loss (Eq. 4-7): (1 - l1 - l2) * SupInfoNCE(x; x+, x-) + l1 * L1 + l2 * L2, l1 = 0.1 (--ski-weight-1), l2 = 0.3
(--ski-weight-2), tau = 0.05. --reading text (default): L1 pulls the SKI to the entailment against the batch's
entailments and contradictions, L2 is SupInfoNCE(x; x_ski, x-); --reading printed: Eq. 5 and 6 exactly as printed
(the contradiction as L1's positive, x_ski missing from L2's denominator). Rows without SKI use SupInfoNCE alone.
--encoder full (default, the paper) or prompted (frozen backbone + DCPCSE deep prefix).

--scale paper (appendix A): bert-base-uncased, batch 512, lr 1e-4 (prompted: DCPCSE's 5e-3, prefix 12), max length
128, 3 epochs, MLP head kept at inference.
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 5e-5 (prompted 3e-2, prefix 12), sentences 32 tokens,
SKI 64 tokens; the SmolLM2 SKI shipped with st_prompts (premises of the first 2,000 shared NLI triplets) unless
--ski-file.

    python recipes/skicse_sup.py --data-dir ../shared/data
    python recipes/skicse_sup.py --data-dir ../shared/data --encoder prompted --reading printed
"""

from _common import main

if __name__ == "__main__":
    main("skicse", supervised=True, description=__doc__)
