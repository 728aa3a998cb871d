"""Sentence retrieval on an STS split (the retrieval study of D2CSE and DiffCSE): each pair scored exactly 5 is a query
and its one answer, among every distinct sentence of the split but the query's own text (the papers' numbers need that
exclusion). ``bidirectional=True`` scores both directions (D2CSE's Table 4 values are multiples of 1/194, not 1/97)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
from sentence_transformers.util import cos_sim

from st_prompts.errors import ConfigurationError, DataFormatError
from st_prompts.evaluation.pairs import PairsEvaluator, check_pair_lengths

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from typing_extensions import Unpack

    from st_prompts.evaluation.pairs import PairsOptions

#: Cut-offs reported as ``recall@k``, and of the mean reciprocal rank (``mrr@10``).
DEFAULT_RECALL_AT_K = (1, 3, 5, 10)
MRR_AT_K = 10


@dataclass(frozen=True)
class RetrievalQueries:
    """The retrieval set-up derived from an STS split: each query and its answer, the pool (every distinct sentence,
    in order of first appearance), the relevant pairs and how many of them were dropped as identical."""

    queries: list[str]
    answers: list[str]
    pool: list[str]
    num_relevant_pairs: int
    num_identical_dropped: int


def build_retrieval_queries(sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float],
                            relevant_score: float = 5.0, bidirectional: bool = False) -> RetrievalQueries:
    """The queries (pairs scored exactly ``relevant_score``) and the candidate pool of an STS split."""
    check_pair_lengths(sentences1, sentences2, scores)
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

    Results: ``{name}_recall@1``, ``@3``, ``@5``, ``@10`` and ``{name}_mrr@10`` (fractions); the primary metric is
    recall@1. ``exclude_query=False`` keeps the query's own text among its candidates (to show what the exclusion
    changes). Raises DataFormatError if the split yields no query.
    """

    csv_prefix = "STS-Retrieval_evaluation"

    def __init__(self, sentences1: Sequence[str], sentences2: Sequence[str], scores: Sequence[float], *,
                 relevant_score: float = 5.0, bidirectional: bool = False, exclude_query: bool = True,
                 recall_at_k: Sequence[int] = DEFAULT_RECALL_AT_K, **options: Unpack[PairsOptions]) -> None:
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
            raise DataFormatError(f"{self._where()}no retrieval query: no sentence pair has gold score "
                                  f"{self.relevant_score:g} ({setup.num_relevant_pairs} such pairs, "
                                  f"{setup.num_identical_dropped} dropped because both sentences are identical)")
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
            self._mask[torch.arange(self.num_queries), torch.tensor([index[q] for q in setup.queries])] = True

        max_k = max(max(self.recall_at_k), MRR_AT_K)
        # one corpus chunk: the score function sees the whole (queries x pool) matrix, which the mask is built for
        self._ir = InformationRetrievalEvaluator(
            queries=dict(zip(query_ids, setup.queries)), corpus=dict(zip(corpus_ids, setup.pool)),
            relevant_docs=relevant_docs, corpus_chunk_size=self.pool_size, mrr_at_k=[MRR_AT_K], ndcg_at_k=[MRR_AT_K],
            accuracy_at_k=self.recall_at_k, precision_recall_at_k=self.recall_at_k, map_at_k=[max_k],
            score_functions={"cosine": self._cosine_without_query}, main_score_function="cosine",
            batch_size=self.batch_size, show_progress_bar=self.show_progress_bar, name=self.name, write_csv=False)
        self.csv_headers = ["epoch", "steps"] + [f"recall@{k}" for k in self.recall_at_k] + [f"mrr@{MRR_AT_K}"]

    def _cosine_without_query(self, query_embeddings: torch.Tensor, pool_embeddings: torch.Tensor) -> torch.Tensor:
        scores = cos_sim(query_embeddings, pool_embeddings)
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
        return (f"STS retrieval{f' on {self.name}' if self.name else ''}: {self.num_queries} queries, candidate pool "
                f"of {self.pool_size} distinct sentences{excluded}: {values}")

    def get_config_dict(self) -> dict[str, Any]:
        """Options that differ from the protocol's defaults (shown in model cards)."""
        options = {"relevant_score": (self.relevant_score, 5.0), "bidirectional": (bool(self.bidirectional), False),
                   "exclude_query": (bool(self.exclude_query), True)}
        return {key: value for key, (value, default) in options.items() if value != default}
