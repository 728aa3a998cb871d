"""Several ``st-prompts serve`` replicas as one: probe them, and send one admin change to each (docs/serving.md:
Replicas). Standard library only, never through the environment's HTTP proxies: replicas are addressed directly.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from st_prompts.errors import ConfigurationError, ReplicasDisagreeError, printable, shorten

__all__ = ["CHANGES", "ReplicaState", "apply_everywhere", "disagreement", "probe", "probe_all", "replica_url"]

#: The admin changes that can be sent to every replica: op -> (method, path template, the status and error code of a
#: replica in the wanted state already).
CHANGES = {
    "add_set": ("POST", "/admin/prompt-sets", (409, "name_taken")),
    "remove_set": ("DELETE", "/admin/prompt-sets/{name}", (404, "model_not_found")),
    "reload_index": ("POST", "/admin/indexes/{name}/reload", None),
}


@dataclass
class ReplicaState:
    """What one replica's ``GET /health`` said (``status`` None: no answer, ``error`` says why)."""

    url: str
    status: int | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ready(self) -> bool:
        """Whether a load balancer would send it requests: 200, and not draining."""
        return self.status == 200 and self.payload.get("ready", True) is True

    @property
    def fingerprint(self) -> str | None:
        return self.payload.get("fingerprint")

    def describe(self) -> str:
        """One line: the URL, ready or why not, and (when it answered) its pid, fingerprint and sets."""
        if self.status is None:
            return f"{self.url}  unreachable: {self.error}"
        if not self.ready:
            return f"{self.url}  not ready: {self.status} {printable(self.payload.get('status', self.error))}"
        sets = self.payload.get("sets") or {}
        shown = ", ".join(printable(name) for name in list(sets)[:8]) + (", ..." if len(sets) > 8 else "")
        return (f"{self.url}  ready  pid {self.payload.get('pid')}  fingerprint {self.fingerprint}  "
                f"{len(sets)} set{'s' * (len(sets) != 1)}{': ' + shown if sets else ''}")


def replica_url(text: str) -> str:
    """``text`` as a replica's base URL (``http(s)://host[:port][/prefix]``, no trailing slash)."""
    parsed = urllib.parse.urlsplit(text.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query or parsed.fragment:
        raise ConfigurationError(f"--replica takes a base URL such as http://10.0.0.5:8000, got {shorten(text)}")
    try:
        parsed.port  # noqa: B018 - raises on a port out of range
    except ValueError as exc:
        raise ConfigurationError(f"--replica {shorten(text)}: {exc}") from exc
    return text.strip().rstrip("/")


def _call(url: str, method: str = "GET", body: Any = None, token: str | None = None,
          timeout: float = 5.0) -> tuple[int, dict[str, Any]]:
    """One HTTP call: (status, the JSON object answered or ``{}``); ``OSError`` when there is no answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        # never through $http_proxy: replicas are addressed directly
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:  # an answer all the same (4xx, 5xx)
        status, raw = exc.code, exc.read()
    try:
        payload = json.loads(raw)
    except ValueError:
        payload = {}
    return status, payload if isinstance(payload, dict) else {}


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None) or exc
    return printable(str(getattr(reason, "strerror", None) or reason))[:120]


def probe(url: str, timeout: float = 5.0) -> ReplicaState:
    """``GET URL/health`` (a draining replica answers 503; one that is loading refuses the connection)."""
    try:
        status, payload = _call(f"{url}/health", timeout=timeout)
    except OSError as exc:
        return ReplicaState(url, error=_reason(exc))
    return ReplicaState(url, status, payload, None if status == 200 else _message(payload, status))


def probe_all(urls: list[str], timeout: float = 5.0) -> list[ReplicaState]:
    """:func:`probe` of every replica, at once."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        return list(pool.map(lambda url: probe(url, timeout), urls))


def disagreement(states: list[ReplicaState]) -> str | None:
    """Why these replicas cannot be used as one (one line), or ``None``."""
    unready = [state for state in states if not state.ready]
    if unready:
        return "; ".join(state.describe() for state in unready)
    groups: dict[str | None, list[str]] = {}
    for state in states:
        groups.setdefault(state.fingerprint, []).append(state.url)
    if len(groups) > 1:
        shown = "; ".join(f"{', '.join(urls)} serve {fingerprint}" for fingerprint, urls in groups.items())
        return f"the replicas serve different sets: {shown} (st-prompts replicas check lists their sets)"
    return None


def _message(payload: dict[str, Any], status: int) -> str:
    error = payload.get("error")
    if isinstance(error, dict) and error.get("message"):
        return printable(str(error["message"]))[:300]
    return printable(str(payload.get("status") or f"HTTP {status}"))


def apply_everywhere(urls: list[str], op: str, name: str, source: str | None = None, token: str | None = None,
                     timeout: float = 120.0, probe_timeout: float = 5.0) -> list[ReplicaState]:
    """Send the admin change ``op`` (:data:`CHANGES`) on the set or index ``name`` (``source``: an added set's folder)
    to every replica in turn, then check that they agree; returns their states after it.

    Raises :class:`ConfigurationError` when nothing was changed (a replica not ready, the first one refused), and
    :class:`ReplicasDisagreeError` when a later replica failed or they serve different sets after it.
    """
    method, template, done = CHANGES[op]
    before = probe_all(urls, probe_timeout)
    unready = [state for state in before if not state.ready]
    if unready:
        raise ConfigurationError(f"nothing was changed: {'; '.join(state.describe() for state in unready)}")
    path = template.format(name=urllib.parse.quote(name, safe=""))
    body = {"name": name, "source": source} if op == "add_set" else None
    changed, failed = [], []
    for url in urls:
        try:
            status, payload = _call(f"{url}{path}", method, body, token, timeout)
        except OSError as exc:
            failed.append(f"{url}: no answer ({_reason(exc)})")
            continue
        code = (payload.get("error") or {}).get("code") if isinstance(payload.get("error"), dict) else None
        if 200 <= status < 300 or (done is not None and (status, code) == done):
            changed.append(url)
        elif not changed and not failed:
            # the first replica's checks decide: the folder, the name, the token are the same for every replica
            raise ConfigurationError(f"{url} refused it ({status}): {_message(payload, status)} Nothing was changed.")
        else:
            failed.append(f"{url}: {status} {_message(payload, status)}")
    after = probe_all(urls, probe_timeout)
    problems = list(failed)
    if op in ("add_set", "remove_set"):
        wanted = op == "add_set"
        problems += [f"{state.url} {'does not serve' if wanted else 'still serves'} {printable(repr(name))}"
                     for state in after if state.ready and (name in state.payload.get("sets", {})) != wanted]
    differ = disagreement(after)
    if differ is not None:
        problems.append(differ)
    if problems:
        raise ReplicasDisagreeError(f"{op.replace('_', '-')} {printable(repr(name))}: done on {len(changed)} of "
                                    f"{len(urls)} replicas; {'; '.join(problems)}. Fix it and run the same command "
                                    "again (a replica that is done already counts as done).")
    return after
