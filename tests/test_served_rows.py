"""The server's path from text to vector (:meth:`ServedModel.tokenize`, then :func:`st_prompts.encode_rows`) gives every
row as ``model.encode`` does: sets per row, query/document sides, a Router, a template. No server process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_bank, st_model
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Router
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from st_prompts import PromptedTransformer, encode_rows
from st_prompts.errors import ConfigurationError
from st_prompts.serving.model import DOCUMENT_ROLE, QUERY_ROLE, ServedModel

TEXTS = ["the man plays guitar .", "a dog runs in the park with a red car and a big tree near the water", "the cat",
         "this is happy music", " ".join(["long"] * 200), "blue"]


def test_a_mixed_request_is_token_ids_and_every_row_is_as_encode_gives_it(tiny_bert):
    served = ServedModel(random_bank(tiny_bert, a=4, b=6), "bank")
    rows, tokens = served.tokenize(TEXTS, "a")
    assert served._ids_rows and all(isinstance(row, list) for row in rows)
    assert tokens == [len(row) for row in rows] and max(tokens) == served.max_seq_length  # truncated as the model does
    routes = ["a", "b", "backbone", "a", "b", "backbone"]
    got = served.encode(rows, routes)
    for route in set(routes):
        alone = served.model.encode([t for t, r in zip(TEXTS, routes) if r == route], task=route)
        assert np.abs(got[[i for i, r in enumerate(routes) if r == route]] - alone).max() < 1e-5


def test_a_side_with_a_prompt_that_the_pooling_leaves_out(tiny_bert):
    """encode_query puts the prompt before the text and, with include_prompt=False, leaves its tokens out of the
    mean: the server's rows (the prompt inside the ids) give the same vectors, in a pass with document rows."""
    transformer = Transformer(tiny_bert)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean", include_prompt=False)
    model = SentenceTransformer(modules=[transformer, pooling], device="cpu",
                                prompts={"query": "query: a long prompt here ", "document": "passage: "})
    served = ServedModel(model, "plain")
    assert served._prompt_lengths[QUERY_ROLE] > 3
    queries, _ = served.tokenize(TEXTS[:3], QUERY_ROLE)
    documents, _ = served.tokenize(TEXTS[3:], DOCUMENT_ROLE)
    got = served.encode(queries + documents, [QUERY_ROLE] * 3 + [DOCUMENT_ROLE] * 3)
    assert np.abs(got[:3] - model.encode_query(TEXTS[:3])).max() < 1e-5
    assert np.abs(got[3:] - model.encode_document(TEXTS[3:])).max() < 1e-5
    with_prompt = st_model(tiny_bert)
    with_prompt.prompts = {"query": "query: a long prompt here "}
    assert np.abs(got[:3] - with_prompt.encode_query(TEXTS[:3])).max() > 1e-4  # the exclusion mattered


def test_a_router_routes_each_side_and_token_ids_are_refused_for_it(tiny_bert):
    torch.manual_seed(0)
    router = Router.for_query_document(query_modules=[Transformer(tiny_bert)],
                                       document_modules=[Transformer(tiny_bert)])
    with torch.no_grad():
        for parameter in router.sub_modules["document"].parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    model = SentenceTransformer(modules=[router, Pooling(32, pooling_mode="mean")], device="cpu")
    served = ServedModel(model, "routed")
    assert not served._ids_rows
    routes = [QUERY_ROLE, DOCUMENT_ROLE, QUERY_ROLE, DOCUMENT_ROLE, DOCUMENT_ROLE, QUERY_ROLE]
    rows, _ = served.tokenize(TEXTS, QUERY_ROLE)
    assert rows == TEXTS
    got = served.encode(rows, routes)
    queries = [i for i, r in enumerate(routes) if r is QUERY_ROLE]
    documents = [i for i, r in enumerate(routes) if r is DOCUMENT_ROLE]
    assert np.abs(got[queries] - model.encode_query([TEXTS[i] for i in queries])).max() < 1e-5
    assert np.abs(got[documents] - model.encode_document([TEXTS[i] for i in documents])).max() < 1e-5
    with pytest.raises(ConfigurationError, match="give texts"):
        encode_rows(model, [[101, 102]], ["query"])


def test_a_template_keeps_texts(tiny_bert):
    model = st_model(PromptedTransformer(tiny_bert, prefix_length=4, template='This sentence : "[X]" means [MASK] .'))
    served = ServedModel(model, "templated")
    assert not served._ids_rows
    rows, tokens = served.tokenize(TEXTS, None)
    assert rows == TEXTS and len(tokens) == len(TEXTS)
    assert np.abs(served.encode(rows, [None] * len(rows)) - model.encode(TEXTS)).max() < 1e-5


@pytest.mark.parametrize("rows_are", ["texts", "ids"])
def test_prefetching_the_next_batch_gives_the_same_vectors(tiny_bert, rows_are):
    """The accelerator path (next batch prepared on a second thread, outputs kept until the end), forced on the CPU:
    the vectors are bit for bit those of the plain loop, in the rows' order, tensors too."""
    model = random_bank(tiny_bert, a=4, b=6)
    texts = TEXTS * 3
    tasks = ["a", "b", None] * 6
    rows = texts if rows_are == "texts" else ServedModel(model, "bank").tokenize(texts, "a")[0]
    plain = encode_rows(model, rows, tasks, batch_size=4, prefetch=False)
    fetched = encode_rows(model, rows, tasks, batch_size=4, prefetch=True)
    assert np.array_equal(plain, fetched) and np.abs(plain).max() > 0
    tensor = encode_rows(model, rows, tasks, batch_size=4, prefetch=True, convert_to_tensor=True)
    assert torch.equal(tensor, torch.as_tensor(plain))
    assert encode_rows(model, rows[:3], tasks[:3], batch_size=8, prefetch=True).shape == (3, plain.shape[1])
