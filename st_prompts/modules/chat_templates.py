"""Chat templates of loaded models (Jinja code from the model folder, which sentence-transformers 6 renders every text
through): :func:`guard_chat_templates` drops an encoder's, and bounds a decoder's renders in time
(:data:`RENDER_SECONDS`, main thread only) and size (:data:`RENDER_CHARS`), any failure being one ConfigurationError.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from st_prompts.errors import ConfigurationError, StPromptsError
from st_prompts.modules.load_errors import describe

logger = logging.getLogger(__name__)

#: The longest a decoder's chat template may take to render one batch, in seconds.
RENDER_SECONDS = 10.0
#: The most characters (or token ids) one rendered conversation may have.
RENDER_CHARS = 1_000_000


def _is_decoder(module: Any) -> bool:
    """Whether ``module``'s transformers model has causal attention (a decoder), read from its attention modules."""
    model = getattr(module, "auto_model", None) or getattr(module, "model", None)
    if model is None or not hasattr(model, "modules"):
        return False
    return any(getattr(sub, "is_causal", False) is True for sub in model.modules())


def guard_chat_templates(model: Any) -> Any:
    """Make the chat templates of ``model`` (a model or one module) safe on untrusted folders; returns ``model``."""
    modules = list(model) if hasattr(model, "__iter__") else [model]
    for module in modules:
        config = getattr(module, "modality_config", None)
        if not isinstance(config, dict) or "message" not in config:
            continue
        holders = [h for h in (getattr(module, "processor", None), getattr(module, "tokenizer", None)) if h is not None]
        if not _is_decoder(module) and "text" in config:
            module.modality_config = {key: value for key, value in config.items() if key != "message"}
            for holder in holders:
                if getattr(holder, "chat_template", None) is not None:
                    holder.chat_template = None
            logger.debug(f"{type(module).__name__}: an encoder needs no chat template; texts are not rendered.")
            continue
        for holder in holders:
            original = holder.apply_chat_template
            if not getattr(original, "_st_prompts_bounded", False):
                holder.apply_chat_template = _bounded(original)
    return model


def _bounded(render: Callable[..., Any]) -> Callable[..., Any]:
    def bounded(*args: Any, **kwargs: Any) -> Any:
        try:
            with _time_limit(RENDER_SECONDS):
                result = render(*args, **kwargs)
        except StPromptsError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a template read from a model folder
            raise ConfigurationError(f"the model's chat template failed to render ({describe(exc)}); fix or remove "
                                     "its chat_template") from exc
        _check_size(result)
        return result

    bounded._st_prompts_bounded = True  # type: ignore[attr-defined]
    return bounded


def _check_size(result: Any) -> None:
    items = result if isinstance(result, list) else [result]
    for item in items:
        if isinstance(item, (str, list)) and len(item) > RENDER_CHARS:
            raise ConfigurationError(f"the model's chat template rendered {len(item):,} characters or tokens for one "
                                     f"text (the most allowed is {RENDER_CHARS:,}); fix or remove its chat_template")


class _RenderTimeout(BaseException):  # not caught by the template engine's own handlers
    pass


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`ConfigurationError` after ``seconds`` (a timer signal: in the main thread only)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):  # noqa: ARG001
        raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _RenderTimeout:
        raise ConfigurationError(f"the model's chat template took more than {seconds:g} s to render one batch; fix "
                                 "or remove its chat_template") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
