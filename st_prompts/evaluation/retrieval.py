"""Sentence retrieval on an STS split: recall@K and MRR@10 (the retrieval study of D2CSE and DiffCSE).

Protocol (D2CSE, Sec. 4.2 "Sentence Retrieval", following DiffCSE):

* **Queries.** Every sentence pair of the split whose gold score is exactly ``5.0`` ("5 out of 5") gives one query:
  the first sentence is the query and its pair is the one relevant answer. Pairs whose two sentences are the same
  string are dropped (the answer would be the query itself); D2CSE reports 97 such pairs on the STS-B test split.
  Pairs are not de-duplicated: a score-5 pair that occurs twice in the split is two queries.
* **Candidate pool.** Every distinct sentence of the split, from both columns (first-appearance order).
* **Self-exclusion.** The query's own text is in the pool (the pool is every sentence of the split) and would
  trivially be retrieved at rank 1, so it is removed from that query's candidates. The papers do not spell this
  out, but their numbers need it: with the query in the pool recall@1 would be ~0, not the ~90 % they report, and
  D2CSE's Table 3 lists the top-5 candidates of the query "yes you got it." without the query itself.
* **Similarity** is cosine, as in the papers.

The metrics are those of :class:`~sentence_transformers.sentence_transformer.evaluation.InformationRetrievalEvaluator`,
which does the encoding, ranking (ties broken by candidate order) and scoring here. It has no per-query exclusion
(its ``compute_all_metrics`` deliberately does not skip ``corpus_id == query_id``), so the exclusion is done in the
score function handed to it: the cosine matrix of all queries against the whole pool (one corpus chunk) with the
query's own candidate set to ``-inf``, which puts it below every real candidate. With exactly one relevant answer
per query, recall@k equals accuracy@k (hit rate); MRR is MRR@10 (a reciprocal rank of 0 when the answer is not in
the top 10), which is what ``InformationRetrievalEvaluator`` computes, hence the key name ``mrr@10``.

Note on the paper's numbers: D2CSE's Table 4 values (e.g. 90.21, 91.24, 97.42, 99.48) are all multiples of 1/194
and not of 1/97, which suggests the paper scored each of its 97 pairs in both directions (194 queries).
``bidirectional=True`` reproduces that reading; the default follows the protocol as the paper describes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.util import cos_sim

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.evaluation.pairs import PairsEvaluator

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from typing_extensions import Unpack

    from st_prompts.evaluation.pairs import PairsOptions

#: Cut-offs reported as ``recall@k``.
DEFAULT_RECALL_AT_K = (1, 3, 5, 10)
#: Cut-off of the reported mean reciprocal rank (``mrr@10``).
MRR_AT_K = 10


@dataclass(frozen=True)
class RetrievalQueries:
    """The retrieval set-up derived from an STS split (see :func:`build_retrieval_queries`).

    Attributes:
        queries: query text of each query.
        answers: the one relevant answer of each query (same length as ``queries``).
        pool: every distinct sentence of the split, both columns, in order of first appearance.
        num_relevant_pairs: pairs with the relevant gold score, before dropping identical ones.
        num_identical_dropped: relevant pairs dropped because their two sentences are the same string.
    """

    queries: list[str]
    answers: list[str]
    pool: list[str]
    num_relevant_pairs: int
    num_identical_dropped: int


def build_retrieval_queries(
    sentences1: Sequence[str],
    sentences2: Sequence[str],
    scores: Sequence[float],
    relevant_score: float = 5.0,
    bidirectional: bool = False,
) -> RetrievalQueries:
    """Select the queries and build the candidate pool of an STS split (the protocol of the module docstring).

    Args:
        sentences1, sentences2, scores: the pairs of the split and their gold scores.
        relevant_score: a pair is a query/answer pair when its gold score equals this value exactly.
        bidirectional: also use the second sentence as a query with the first as its answer (two queries per pair).

    Raises:
        DataFormatError: if the three lists differ in length.
    """
    if not (len(sentences1) == len(sentences2) == len(scores)):
        raise DataFormatError(
            f"sentences1, sentences2 and scores must have the same length, got "
            f"{len(sentences1)}, {len(sentences2)} and {len(scores)}"
        )
    pool = list(dict.fromkeys(s for pair in zip(sentences1, sentences2) for s in pair))  # distinct, in order
    queries: list[str] = []
    answers: list[str] = []
    num_relevant = num_identical = 0
    for s1, s2, score in zip(sentences1, sentences2, scores):
        if float(score) != relevant_score:
            continue
        num_relevant += 1
        if s1 == s2:
            num_identical += 1
            continue
        queries.append(s1)
        answers.append(s2)
        if bidirectional:
            queries.append(s2)
            answers.append(s1)
    return RetrievalQueries(queries, answers, pool, num_relevant, num_identical)


class STSRetrievalEvaluator(PairsEvaluator):
    """Recall@K and MRR@10 of retrieving the gold-score-5 partner of a sentence among all sentences of an STS split.

    See the module docstring for the protocol. Results (``name`` prefix omitted when ``name`` is empty):
    ``{name}_recall@1``, ``@3``, ``@5``, ``@10`` (fractions in [0, 1]) and ``{name}_mrr@10``. The primary metric is
    recall@1 (greater is better).

    Args:
        sentences1, sentences2, scores: the pairs of the split and their gold scores.
        relevant_score: gold score that makes a pair a query/answer pair (exact match).
        bidirectional: score each pair in both directions (see the module docstring).
        exclude_query: remove the query's own text from its candidates (default). ``False`` keeps it, so that
            the query usually retrieves itself first; only useful to show what the exclusion changes.
        recall_at_k: cut-offs reported as ``recall@k``.
        **options: ``name``, ``batch_size``, ``show_progress_bar`` and ``write_csv`` (a row per call in
            ``STS-Retrieval_evaluation_{name}_results.csv``), as for every
            :class:`~st_prompts.evaluation.pairs.PairsEvaluator`.

    Attributes:
        num_queries, pool_size, num_identical_dropped: sizes of the set-up, for reports.
        task, split: see :class:`~st_prompts.evaluation.pairs.PairsEvaluator` (set by ``from_senteval``).

    Raises:
        DataFormatError: if the split yields no query.
    """

    csv_prefix = "STS-Retrieval_evaluation"

    def __init__(
        self,
        sentences1: Sequence[str],
        sentences2: Sequence[str],
        scores: Sequence[float],
        *,
        relevant_score: float = 5.0,
        bidirectional: bool = False,
        exclude_query: bool = True,
        recall_at_k: Sequence[int] = DEFAULT_RECALL_AT_K,
        **options: Unpack[PairsOptions],
    ) -> None:
        super().__init__(sentences1, sentences2, scores, **options)
        if not recall_at_k or any(int(k) < 1 for k in recall_at_k):
            raise ConfigurationError(f"recall_at_k must be positive integers, got {list(recall_at_k)}")
        self.relevant_score = float(relevant_score)
        self.bidirectional = bidirectional
        self.exclude_query = exclude_query
        self.recall_at_k = sorted({int(k) for k in recall_at_k})
        self.primary_metric = f"recall@{self.recall_at_k[0]}"

        setup = build_retrieval_queries(sentences1, sentences2, scores, self.relevant_score, bidirectional)
        if not setup.queries:
            raise DataFormatError(
                f"{self._where()}no retrieval query: no sentence pair has gold score {self.relevant_score:g} "
                f"({setup.num_relevant_pairs} such pairs, {setup.num_identical_dropped} dropped because both "
                f"sentences are identical)"
            )
        self.setup = setup
        self.num_queries = len(setup.queries)
        self.pool_size = len(setup.pool)
        self.num_identical_dropped = setup.num_identical_dropped

        width = len(str(max(self.num_queries, self.pool_size)))
        # Zero-padded ids: InformationRetrievalEvaluator breaks score ties by ascending id, i.e. by pool order.
        corpus_ids = [f"c{i:0{width}d}" for i in range(self.pool_size)]
        index = {text: i for i, text in enumerate(setup.pool)}
        query_ids = [f"q{i:0{width}d}" for i in range(self.num_queries)]
        relevant_docs = {qid: {corpus_ids[index[answer]]} for qid, answer in zip(query_ids, setup.answers)}
        # Row q of the mask marks the pool entry holding the text of query q.
        self._mask = torch.zeros(self.num_queries, self.pool_size, dtype=torch.bool)
        if exclude_query:
            rows = torch.arange(self.num_queries)
            self._mask[rows, torch.tensor([index[q] for q in setup.queries])] = True

        max_k = max(max(self.recall_at_k), MRR_AT_K)
        self._ir = InformationRetrievalEvaluator(
            queries=dict(zip(query_ids, setup.queries)),
            corpus=dict(zip(corpus_ids, setup.pool)),
            relevant_docs=relevant_docs,
            # One chunk: the score function sees the whole (queries x pool) matrix, which the mask is built for.
            corpus_chunk_size=self.pool_size,
            mrr_at_k=[MRR_AT_K],
            ndcg_at_k=[MRR_AT_K],
            accuracy_at_k=self.recall_at_k,
            precision_recall_at_k=self.recall_at_k,
            map_at_k=[max_k],
            score_functions={"cosine": self._cosine_without_query},
            main_score_function="cosine",
            batch_size=self.batch_size,
            show_progress_bar=self.show_progress_bar,
            name=self.name,
            write_csv=False,
        )
        self.csv_headers = ["epoch", "steps"] + [f"recall@{k}" for k in self.recall_at_k] + [f"mrr@{MRR_AT_K}"]

    def _cosine_without_query(self, query_embeddings: torch.Tensor, pool_embeddings: torch.Tensor) -> torch.Tensor:
        scores = cos_sim(query_embeddings, pool_embeddings)
        if scores.shape != self._mask.shape:  # pragma: no cover - guards against a change in the chunking
            raise RuntimeError(
                f"expected a {tuple(self._mask.shape)} (queries x pool) score matrix, got {tuple(scores.shape)}"
            )
        return scores.masked_fill(self._mask.to(scores.device), -math.inf)

    def compute(self, model: SentenceTransformer) -> dict[str, float]:
        """Encode the queries and the pool with ``model``; return recall@k and MRR@10 (fractions, no prefix)."""
        scores = self._ir.compute_all_metrics(model)["cosine"]
        metrics: dict[str, float] = {f"recall@{k}": float(scores["recall@k"][k]) for k in self.recall_at_k}
        metrics[f"mrr@{MRR_AT_K}"] = float(scores["mrr@k"][MRR_AT_K])
        return metrics

    def describe(self, metrics: dict[str, float]) -> str:
        """The log line of a call: the set-up and the metrics."""
        excluded = " (each query's own text excluded)" if self.exclude_query else ""
        values = ", ".join(f"{key} {value:.4f}" for key, value in metrics.items())
        return (
            f"STS retrieval{f' on {self.name}' if self.name else ''}: {self.num_queries} queries, candidate pool of "
            f"{self.pool_size} distinct sentences{excluded}: {values}"
        )

    def get_config_dict(self) -> dict[str, Any]:
        """Options that differ from the protocol's defaults (shown in model cards)."""
        config: dict[str, Any] = {}
        if self.relevant_score != 5.0:
            config["relevant_score"] = self.relevant_score
        if self.bidirectional:
            config["bidirectional"] = True
        if not self.exclude_query:
            config["exclude_query"] = False
        return config
