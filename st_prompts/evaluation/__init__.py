"""Evaluators: the SentEval STS suite, D2CSE's recall@K retrieval, and alignment/uniformity (one shared base for
the evaluators over the pairs of one STS split: :class:`PairsEvaluator`)."""

from st_prompts.evaluation.alignment import AlignmentUniformityEvaluator, alignment_loss, uniformity_loss
from st_prompts.evaluation.pairs import PairsEvaluator
from st_prompts.evaluation.retrieval import STSRetrievalEvaluator
from st_prompts.evaluation.sts import STSSuiteEvaluator, format_results_table, stsb_dev_evaluator

__all__ = ["AlignmentUniformityEvaluator", "PairsEvaluator", "STSRetrievalEvaluator", "STSSuiteEvaluator",
           "alignment_loss", "format_results_table", "stsb_dev_evaluator", "uniformity_loss"]
