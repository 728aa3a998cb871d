"""What a server serves, as digests that replicas can compare: one per prompt set, one for the whole model.

Replicas behind a load balancer must serve the same task names with the same weights, or a client's vectors depend
on which replica answered. ``/health`` reports :func:`set_digest` of every served set and :func:`served_fingerprint`
of the whole, so that ``st-prompts replicas check`` (and any script) can tell that every replica agrees after a
prompt-set change or a rolling restart. A digest is of the tensors' values (names, dtypes, shapes and bytes), not of
a folder or a name: a set added at run time and the same set read from a bank folder after
``st-prompts bank add`` give the same digest. The backbone enters as the bank's fingerprint of its weights (computed
once at start); a model without prompts is not hashed (its task name stands for it: hashing a large model's weights
would delay every start).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["DIGEST_CHARS", "served_fingerprint", "set_digest"]

#: Hex characters kept of a digest (64 bits: ample to tell a handful of versions apart, short enough to read).
DIGEST_CHARS = 16


def set_digest(module: Any) -> str:
    """The digest of a prompt set's tensors (any ``torch.nn.Module``): the checkpoints' own
    :func:`~st_prompts.modules.checkpoint.backbone_fingerprint` of its state dict, shortened."""
    from st_prompts.modules.checkpoint import backbone_fingerprint

    return backbone_fingerprint(module).removeprefix("sha256:")[:DIGEST_CHARS]


def served_fingerprint(identity: dict[str, Any], sets: dict[str, str]) -> str:
    """The digest of a served model: ``identity`` (its task names, backbone fingerprint, dtype, quantization: JSON
    values) and ``sets`` (public task name -> :func:`set_digest`), whatever the order the names were added in."""
    text = json.dumps({"identity": identity, "sets": sorted(sets.items())}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]
