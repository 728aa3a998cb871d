"""The admin changes a server applies to its model and indexes, in one process or in each worker."""

from __future__ import annotations

__all__ = ["apply_change"]


def apply_change(served, registry, op: str, args: tuple):
    """Apply one admin change here; returns what the admin endpoint answers (``add_set_read``: and the set)."""
    if op == "add_set":
        return served.add_prompt_set(*args)
    if op == "add_set_read":
        answer, data = served.add_prompt_set(*args, with_data=True)
        return {"answer": answer, "data": data}
    if op == "add_set_data":
        return served.add_prompt_set(args[0], args[1], data=args[2])
    if op == "remove_set":
        return served.remove_prompt_set(*args)
    if op == "reload_index":
        return registry.reload(*args).describe()
    raise ValueError(f"unknown change {op!r}")
