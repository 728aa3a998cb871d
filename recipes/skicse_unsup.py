"""SKICSE, unsupervised: each Wikipedia sentence x, its dropout view x' and its LLM-generated SKI x_ski.

Loss (Eq. 1-3): (1 - lambda) * InfoNCE(x; x') + lambda * InfoNCE(x; x_ski), lambda = 0.15 (--ski-weight), tau = 0.05,
in-batch negatives; rows whose SKI is missing use the first term alone.
--encoder full (default, the paper): the whole backbone trains. --encoder prompted: the backbone is frozen and a
DCPCSE deep prefix trains.

--scale paper (appendix A): bert-base-uncased, batch 512, lr 1e-4 (prompted: DCPCSE's 3e-2, prefix 16), max length
128 for sentences and SKI, 1 epoch; SimCSE's 1M sentences from the hub unless --data-dir, and a SKI file for them
(--ski-file, from 'st-prompts ski generate').
--scale cpu (default): packaged all-MiniLM-L6-v2, batch 64, lr 3e-5 (prompted 3e-2), sentences 32 tokens, SKI 64
tokens; the SmolLM2 SKI shipped with st_prompts (the first 2,080 lines of the shared Wikipedia sentences) unless
--ski-file.

    st-prompts ski generate --llm smollm2 --input ../shared/data/train/wiki_sentences.txt --limit 2000 --output ski.jsonl
    python recipes/skicse_unsup.py --data-dir ../shared/data --ski-file ski.jsonl --encoder prompted
"""

from _common import main

if __name__ == "__main__":
    main("skicse", supervised=False, description=__doc__)
