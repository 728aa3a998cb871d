"""An embedding run: a corpus file into a folder of Parquet parts (``embed.json`` and ``part-NNNNN.parquet``), on this
machine or a Ray cluster (``docs/scale.md``). A rerun with the same settings (not the batch size nor the engine: they
change how fast, not what) skips every part whose record matches; other settings, or a foreign folder, are refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from st_prompts.embedding.encoder import ModelSpec, check_tasks, encode_part
from st_prompts.embedding.inputs import InputPart, InputSource, read_part, read_parts
from st_prompts.errors import ConfigurationError, DataFormatError, StPromptsError
from st_prompts.numbers import positive_int
from st_prompts.search.embedding_files import (FORMAT_NAME, FORMAT_VERSION, RUN_FILE, identity_from_record,
                                               identity_record, part_name, part_record, write_part)
from st_prompts.storage import folder_lock, write_json_atomic
from st_prompts.utils import recorded_model_name

logger = logging.getLogger(__name__)

DEFAULT_PART_ROWS = 100_000
_PART_FILE = re.compile(r"^part-(\d{5,})\.parquet$")
_LEFTOVER = re.compile(r"^\.(part-\d{5,}\.parquet|embed\.json)\.st-prompts-tmp-[0-9a-f]{12}$")


@dataclass
class EmbedResult:
    """What a run did."""

    output: Path
    parts_written: int = 0
    parts_skipped: int = 0
    rows: int = 0  # documents in the folder's parts (blank ones are not documents)
    rows_encoded: int = 0
    blank: int = 0
    seconds: float = 0.0  # encoding and writing (with Ray: actors' start included, the session's start not)
    ray_start: float = 0.0
    nodes: dict[str, int] = field(default_factory=dict)  # who encoded the parts written: node -> parts

    @property
    def rate(self) -> float:
        """Documents encoded a second (this run's)."""
        return self.rows_encoded / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """The run's final line."""
        nodes = f" on {len(self.nodes)} nodes" if len(self.nodes) > 1 else ""
        nodes += f"; Ray started in {self.ray_start:.1f} s" if self.ray_start else ""
        return (f"{self.parts_written} part(s) written, {self.parts_skipped} skipped (already done), {self.rows} "
                f"documents in {self.output}; encoded {self.rows_encoded} in {self.seconds:.1f} s "
                f"({self.rate:.1f}/s){nodes}")


@dataclass
class RayOptions:
    """``--engine ray``: the cluster (``None``: start a local Ray) and each actor's resources; ``actors=None``: as
    many as the cluster's resources allow."""

    address: str | None = None
    actors: int | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0


def embed_file(model: str | ModelSpec, input_path: str | os.PathLike, output: str | os.PathLike, *,
               text_column: str = "text", id_column: str | None = None, task_column: str | None = None,
               task: str | None = None, part_rows: int = DEFAULT_PART_ROWS, batch_size: int = 64,
               keep_texts: bool = True, engine: str = "local", ray: RayOptions | None = None,
               progress: bool = False) -> EmbedResult:
    """Embed the corpus file ``input_path`` into the folder ``output`` (see the module docstring).

    Args:
        model: a model name or folder (``minilm``: the packaged MiniLM), or a :class:`ModelSpec` (precision, trust).
        input_path: a text file (one document a line), ``.jsonl`` or ``.parquet`` (``text_column``, ``id_column``,
            ``task_column``: each row's prompt set), read ``part_rows`` rows at a time.
        task: the prompt set of a bank for every row (or for rows without a task in ``task_column``).
        keep_texts: write the ``text`` column (``False``: ids and vectors only).
        engine: ``"local"`` (this process) or ``"ray"`` (Ray Data actors; ``ray``: the cluster and resources).

    Returns the :class:`EmbedResult`. Raises one-line :class:`~st_prompts.errors.StPromptsError` subclasses.
    """
    spec = model if isinstance(model, ModelSpec) else ModelSpec(str(model))
    if engine not in ("local", "ray"):
        raise ConfigurationError(f"engine must be 'local' or 'ray', got {engine!r}")
    batch_size = positive_int(batch_size, "batch_size")
    source = InputSource.of(input_path, text_column, id_column, task_column)
    part_rows = positive_int(part_rows, "part_rows")
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise ConfigurationError(f"{output} is a file; the output is a folder of parts")
    if engine == "ray":  # before the model loads: a missing Ray is one line at once
        from st_prompts.embedding.ray_engine import import_ray

        import_ray()
    with folder_lock(output, timeout=0):
        return _run(spec, source, output, task=task, part_rows=part_rows, batch_size=batch_size,
                    keep_texts=keep_texts, engine=engine, ray=ray or RayOptions(), progress=progress)


def _run(spec: ModelSpec, source: InputSource, output: Path, *, task: str | None, part_rows: int, batch_size: int,
         keep_texts: bool, engine: str, ray: RayOptions, progress: bool) -> EmbedResult:
    existing = _existing_parts(output)  # refuses a foreign folder before the model loads
    settings = {"input": {"path": source.path, "kind": source.kind, "text_column": source.text_column,
                          "id_column": source.id_column, "task_column": source.task_column},
                "part_rows": part_rows, "task": task, "texts": keep_texts, "dtype": spec.dtype,
                "quantize": spec.quantize, "trust_remote_code": bool(spec.trust_remote_code)}
    key = "sha256:" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    prior = _prior_run(output, existing, settings, key)  # other settings refused before any model loads
    result = EmbedResult(output)
    done = None
    if engine == "ray":
        done = _run_ray(spec, source, output, existing, prior, settings, key, task=task, part_rows=part_rows,
                       batch_size=batch_size, keep_texts=keep_texts, options=ray, progress=progress, result=result)
    if done is None:  # local, or Ray with nothing to encode: this process loads the model (and checks it)
        from st_prompts.search.identity import ModelIdentity

        model = spec.load("cpu" if engine == "ray" else None)
        check_tasks(model, [task])
        identity = ModelIdentity.of(model, name=recorded_model_name(spec.name), task=task)
        run = _begin_run(output, existing, prior, settings, key, identity_record(identity), identity)
        writer = _PartWriter(output, existing, {"settings_sha256": key, "model": run["model"], "task": task},
                             keep_texts, result)
        started = time.perf_counter()
        _run_local(model, source, part_rows, task, batch_size, progress, writer)
        result.seconds = time.perf_counter() - started
        writer.remove_stale()
        done = run, writer.last + 1
    run, parts = done
    run.update(status="complete", parts=parts, rows=result.rows, blank=result.blank,
               finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               last_run={"engine": engine, "parts_written": result.parts_written,
                         "parts_skipped": result.parts_skipped, "rows_encoded": result.rows_encoded,
                         "seconds": round(result.seconds, 3), "ray_start_seconds": round(result.ray_start, 3),
                         "nodes": result.nodes, "batch_size": batch_size,
                         **({"ray": vars(ray)} if engine == "ray" else {})})
    write_json_atomic(output / RUN_FILE, run)
    return result


def _run_ray(spec: ModelSpec, source: InputSource, output: Path, existing: dict[int, Path],
             prior: dict[str, Any] | None, settings: dict[str, Any], key: str, *, task: str | None, part_rows: int,
             batch_size: int, keep_texts: bool, options: RayOptions, progress: bool,
             result: EmbedResult) -> tuple[dict[str, Any], int] | None:
    """``--engine ray`` with no model in this process (its identity comes from the actors, checked before the first
    part is written): the run and its number of parts, or ``None`` when no part has rows to encode."""
    from st_prompts.embedding.ray_engine import encode_parts_on_ray

    recorded = (prior or {}).get("model")  # what a resumed run's parts were made with (checked in accept below)
    base = {"settings_sha256": key, "model": recorded if isinstance(recorded, dict) else {}, "task": task}
    writer = _PartWriter(output, existing, base, keep_texts, result)
    todo, blank = [], []  # todo: where each part is, not its rows (the input is never held whole)
    for part in tqdm(read_parts(source, part_rows), desc="scanning", unit=" part", disable=not progress):
        writer.last = part.number
        if writer.skip(part):
            continue
        if part.texts:
            todo.append((part.number, part.first_row, part.locator, part.digest, len(part.texts)))
        else:
            blank.append(part)
    if not todo:
        result.parts_skipped = result.rows = result.blank = 0  # counted again by the caller's run
        return None
    state: dict[str, Any] = {}

    def accept(record: dict[str, Any]) -> None:
        identity = identity_from_record(record)
        if "run" in state:  # another actor's model: it must encode as the first one did
            try:
                identity_from_record(state["run"]["model"]).check_compatible(identity)
            except StPromptsError as exc:
                raise type(exc)(f"the Ray actors loaded different models from {spec.name}: {exc}") from None
            return
        state["run"] = _begin_run(output, existing, prior, settings, key, record, identity)
        base["model"] = state["run"]["model"]
        for part in blank:  # nothing to encode, but a part all the same (its rows' places are kept)
            writer.write(part, np.zeros((0, int(record["dimension"])), dtype=np.float32),
                         {"engine": "ray", "node": "driver"})

    timing: dict[str, float] = {}
    started = time.perf_counter()
    encoded = encode_parts_on_ray(spec, source, todo, task=task, batch_size=batch_size, options=options,
                                  name=recorded_model_name(spec.name), accept=accept, progress=progress, timing=timing)
    for number, first_row, locator, digest, vectors, node in encoded:
        part = read_part(source, number, first_row, locator)
        if part.digest != digest:
            raise DataFormatError(f"{source.path} changed while it was embedded (part {number}); run again")
        writer.write(part, vectors, node)
    result.ray_start = timing.get("ray_start", 0.0)
    result.seconds = time.perf_counter() - started - result.ray_start
    writer.remove_stale()
    return state["run"], writer.last + 1


def _run_local(model: Any, source: InputSource, part_rows: int, task: str | None, batch_size: int, progress: bool,
               writer: _PartWriter) -> None:
    import socket

    node = {"engine": "local", "node": socket.gethostname(), "pid": os.getpid()}
    for part in tqdm(read_parts(source, part_rows), desc="parts", unit=" part", disable=not progress):
        writer.last = part.number
        check_tasks(model, part.tasks or [])
        if writer.skip(part):
            continue
        writer.write(part, encode_part(model, part.texts, part.tasks, task, batch_size, progress=False), node)


# ---------------------------------------------------------------------------------------------- the folder
def _existing_parts(output: Path) -> dict[int, Path]:
    """The parts already in ``output``, after refusing a folder holding anything else (leftovers of a killed run
    removed)."""
    if not output.is_dir():
        return {}
    parts, foreign, leftovers = {}, [], []
    for entry in sorted(os.listdir(output)):
        match = _PART_FILE.match(entry)
        if match and (output / entry).is_file():
            parts[int(match.group(1))] = output / entry
        elif _LEFTOVER.match(entry) and (output / entry).is_file():
            leftovers.append(output / entry)
        elif entry != RUN_FILE:
            foreign.append(entry)
    if foreign or (parts and not (output / RUN_FILE).is_file()):
        shown = ", ".join(foreign[:3]) or f"{len(parts)} part(s) without {RUN_FILE}"
        raise ConfigurationError(f"{output} holds files that st-prompts embed did not write ({shown}); embed into "
                                 "a new or empty folder")
    for path in leftovers:
        path.unlink(missing_ok=True)
    return parts


def _prior_run(output: Path, existing: dict[int, Path], settings: dict[str, Any], key: str) -> dict[str, Any] | None:
    """The folder's ``embed.json`` when written with these settings, else ``None`` (a new run); refuses other
    settings over parts, or a run file that is not this command's."""
    path = output / RUN_FILE
    if not path.is_file():  # parts without a run file were refused by _existing_parts
        return None
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataFormatError(f"{path} is not a readable run file ({type(exc).__name__}); embed into a new "
                              "folder") from None
    if not isinstance(run, dict) or run.get("format") != FORMAT_NAME or not isinstance(run.get("settings"), dict):
        raise ConfigurationError(f"{path} was not written by st-prompts embed; embed into a new or empty folder")
    if run.get("settings_sha256") == key:
        return run
    if not existing:  # a run that stopped before its first part: nothing to keep
        return None
    changed = [name for name in sorted(set(settings) | set(run["settings"]))
               if settings.get(name) != run["settings"].get(name)] or ["settings"]
    raise ConfigurationError(f"{output} was embedded with other settings ({', '.join(changed)}: "
                             f"{json.dumps(run['settings'].get(changed[0]))[:120]}, now "
                             f"{json.dumps(settings.get(changed[0]))[:120]}); rerun with them or embed into a new "
                             "folder")


def _begin_run(output: Path, existing: dict[int, Path], prior: dict[str, Any] | None, settings: dict[str, Any],
               key: str, model_record: dict[str, Any], identity: Any) -> dict[str, Any]:
    """``embed.json`` of this run: ``prior`` resumed when its model encodes as ``identity`` does, else a new one."""
    if prior is not None:
        try:
            identity_from_record(prior["model"]).check_compatible(identity)
            return {**prior, "status": "running"}
        except StPromptsError as exc:
            problem: StPromptsError = type(exc)(f"{output} was embedded by another model: {exc}")
        except (KeyError, TypeError, ValueError):
            problem = DataFormatError(f"{output / RUN_FILE} records no readable model; embed into a new folder")
        if existing:
            raise problem
    output.mkdir(parents=True, exist_ok=True)
    run = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "settings": settings, "settings_sha256": key,
           "model": model_record, "status": "running",
           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json_atomic(output / RUN_FILE, run)
    return run


class _PartWriter:
    """Decides which parts are finished and writes the others (one writer: this process)."""

    def __init__(self, output: Path, existing: dict[int, Path], base: dict[str, Any], keep_texts: bool,
                 result: EmbedResult) -> None:
        self.output, self.existing, self.base, self.keep_texts, self.result = output, existing, base, keep_texts, result
        self.last = -1

    def skip(self, part: InputPart) -> bool:
        """Whether ``part`` is finished already: its file's record names these settings, this model and these rows."""
        path = self.existing.get(part.number)
        record = part_record(path) if path is not None else None
        finished = bool(record) and all(record.get(k) == v for k, v in (
            ("settings_sha256", self.base["settings_sha256"]), ("part", part.number), ("first_row", part.first_row),
            ("input_rows", part.input_rows), ("rows_sha256", part.digest), ("rows", len(part.ids)))) and (
            (record.get("model") or {}).get("fingerprint") == self.base["model"].get("fingerprint"))
        if finished:
            self.result.parts_skipped += 1
            self.result.rows += len(part.ids)
            self.result.blank += part.blank
        return finished

    def write(self, part: InputPart, vectors: Any, node: dict[str, Any]) -> None:
        record = {**self.base, "part": part.number, "first_row": part.first_row, "input_rows": part.input_rows,
                  "blank": part.blank, "rows_sha256": part.digest, "encoded_by": node}
        write_part(self.output / part_name(part.number), part.ids, part.texts if self.keep_texts else None, vectors,
                   record)
        self.result.parts_written += 1
        self.result.rows += len(part.ids)
        self.result.rows_encoded += len(part.ids)
        self.result.blank += part.blank
        name = str(node.get("node_id") or node.get("node"))
        self.result.nodes[name] = self.result.nodes.get(name, 0) + 1

    def remove_stale(self) -> None:
        """Remove the parts this command wrote past the input's end (it shrank since)."""
        for number, path in sorted(self.existing.items()):
            if number > self.last and part_record(path) is not None:
                logger.info("removing %s: the input now ends before it", path.name)
                path.unlink(missing_ok=True)
            elif number > self.last:
                raise ConfigurationError(f"{path} is not a part st-prompts embed wrote; embed into a new folder")

