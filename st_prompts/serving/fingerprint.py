"""What a server serves, as digests replicas can compare: one per prompt set (of its tensors' values, not of a folder
or a name), one for the whole model (the backbone: the bank's fingerprint; a model without prompts: its name)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["DIGEST_CHARS", "served_fingerprint", "set_digest"]

#: Hex characters kept of a digest (64 bits).
DIGEST_CHARS = 16


def set_digest(module: Any) -> str:
    """The digest of a prompt set's tensors (any ``torch.nn.Module``), shortened."""
    from st_prompts.modules.checkpoint import backbone_fingerprint

    return backbone_fingerprint(module).removeprefix("sha256:")[:DIGEST_CHARS]


def served_fingerprint(identity: dict[str, Any], sets: dict[str, str]) -> str:
    """The digest of a served model's ``identity`` and ``sets``, whatever order the names came in."""
    text = json.dumps({"identity": identity, "sets": sorted(sets.items())}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]
