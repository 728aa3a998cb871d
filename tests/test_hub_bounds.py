"""Nothing of a planted folder reaches the hub: no kernel is requested (a stand-in ``kernels`` package records every
call, and a control shows transformers asking it), and a hub that never answers fails in seconds, in one line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import edit_json, one_error_line, prompted_model, st_model

SENTEVAL = Path(__file__).parent / "fixtures" / "senteval"
CORPUS = Path(__file__).parent / "fixtures" / "search" / "real_queries.txt"
EVIL_KERNEL = "someone-else/evil-kernel@deadbeef"
#: Calls of the kernels library that fetch (or would fetch) code from the hub.
REQUESTS = ("get_kernel", "kernelize", "load_kernel", "get_locked_kernel", "LayerRepository")

STAND_IN = '''"""A stand-in for the kernels library: records every call, downloads nothing."""
import json
import os


def _record(name, args, kwargs):
    with open(os.environ["KERNELS_LOG"], "a") as handle:
        handle.write(json.dumps({"call": name, "args": [repr(a) for a in args],
                                 "kwargs": {k: repr(v) for k, v in kwargs.items()}}) + "\\n")


class _Stub:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _record(self._name, args, kwargs)
        if len(args) == 1 and isinstance(args[0], type) and not kwargs:
            return args[0]  # used as a class decorator
        return _Stub(self._name + "()")

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())


def get_kernel(*args, **kwargs):
    _record("get_kernel", args, kwargs)
    raise FileNotFoundError("stand-in kernels: nothing is downloaded")


def use_kernel_forward_from_hub(*args, **kwargs):
    return lambda cls: cls


def use_kernelized_func(*args, **kwargs):
    return lambda func: func


def __getattr__(name):
    return _Stub(name)
'''

DRIVER = '''
import json, os, sys
from st_prompts.cli import main
from st_prompts.errors import StPromptsError
from st_prompts.loading import load_sentence_model
for case in json.loads(sys.argv[1]):
    if case[0] == "log":  # where the stand-in records the calls from here on
        os.environ["KERNELS_LOG"] = case[1]
    elif case[0] == "load":
        try:
            load_sentence_model(case[1])
            print("LOADED", case[1])
        except StPromptsError as exc:
            print("REFUSED", str(exc)[:200])
    elif case[0] == "transformers":
        from transformers import AutoModel
        try:
            AutoModel.from_pretrained(case[1])
        except Exception as exc:  # the stand-in downloads nothing: transformers fails after asking
            print("CONTROL", type(exc).__name__)
    else:
        print("EXIT", main(case), case[0])
'''


#: Runs ``st_prompts.cli.main`` on each argv of a JSON list in one fresh process and prints, per call, a JSON line of
#: its exit status, its stderr and its seconds (the hub settings are read from the environment at import).
SILENT_DRIVER = '''
import io, json, sys, time
import faiss, sentence_transformers, transformers  # imported first: the bounds are on each command, not on imports
from st_prompts import cli
for argv in json.loads(sys.argv[1]):
    err, real, start = io.StringIO(), sys.stderr, time.monotonic()
    sys.stderr = err
    try:
        status = cli.main(argv)
    except SystemExit as exc:
        status = exc.code
    finally:
        sys.stderr = real
        cli.reset_output()
    print(json.dumps({"status": status, "err": err.getvalue(), "took": time.monotonic() - start}), flush=True)
'''


def stand_in_kernels(root: Path) -> Path:
    """A folder holding the stand-in ``kernels`` package and its metadata (a version transformers accepts)."""
    from transformers.utils.import_utils import KERNELS_MIN_VERSION

    site = root / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text(STAND_IN)
    dist = site / f"kernels-{KERNELS_MIN_VERSION}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {KERNELS_MIN_VERSION}\n")
    return site


def _run(cases: list, site: Path, log: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "KERNELS_LOG": str(log), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], capture_output=True, text=True,
                            env=env, timeout=540)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result.stdout


def _requests(log: Path) -> list[dict]:
    if not log.exists():
        return []
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [c for c in calls if c["call"].split(".")[0] in REQUESTS or "evil" in json.dumps(c)
            or "flash-attn" in json.dumps(c)]


def test_no_kernel_is_requested_for_a_planted_folder(tiny_bert, tmp_path):
    site = stand_in_kernels(tmp_path)
    clean = tmp_path / "clean"
    st_model(tiny_bert, max_seq_length=32).save(str(clean))
    planted = {}
    for value in (EVIL_KERNEL, "flash_attention_2", {"": "sdpa", "text_config": EVIL_KERNEL}):
        folder = Path(shutil.copytree(clean, tmp_path / f"planted-{len(planted)}"))
        edit_json(folder / "config.json", lambda data: {**data, "attn_implementation": value})
        planted[json.dumps(value)] = folder
    backbone = Path(shutil.copytree(tiny_bert, tmp_path / "backbone"))
    edit_json(backbone / "config.json", lambda data: {**data, "attn_implementation": EVIL_KERNEL})
    bank = tmp_path / "bank"
    from st_prompts.cli import main

    assert main(["bank", "create", str(bank), "--backbone", tiny_bert]) == 0
    for config in bank.rglob("config.json"):
        if "model_type" in json.loads(config.read_text()):
            edit_json(config, lambda data: {**data, "attn_implementation": EVIL_KERNEL})

    log, control_log = tmp_path / "kernels.log", tmp_path / "control.log"
    senteval = ["--senteval-dir", str(SENTEVAL), "--no-progress"]
    folder = planted[json.dumps(EVIL_KERNEL)]
    cases = [["load", str(f)] for f in planted.values()] + [
        ["evaluate", str(folder), "--metrics", "sts", "--tasks", "STSBenchmark", *senteval],
        ["index", "build", str(folder), str(CORPUS), str(tmp_path / "new.index"), "--no-progress"],
        ["train", "simcse", "--backbone", str(backbone), "--max-steps", "1", "--output", str(tmp_path / "out"),
         "--no-progress"],
        ["bank", "list", str(bank)],
        # the control, last in the same process: transformers itself asks the stand-in for the planted repository
        ["log", str(control_log)], ["transformers", str(backbone)],
    ]
    out = _run(cases, site, log)
    assert "CONTROL" in out
    asked = [c for c in _requests(control_log) if c["call"] == "get_kernel"]
    assert asked and "someone-else/evil-kernel" in json.dumps(asked[0]), asked
    assert out.count("REFUSED") == len(planted) and "LOADED" not in out, out
    assert out.count("EXIT 2") == 4, out
    assert _requests(log) == [], _requests(log)
    assert not (tmp_path / "out").exists() and not (tmp_path / "new.index").exists()


# ------------------------------------------------------------------------------------------- a silent hub
@pytest.fixture
def silent_hub():
    """A port on 127.0.0.1 that takes connections (the kernel's backlog: nobody accepts them) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_hub_that_never_answers_fails_in_seconds(tiny_bert, tmp_path, silent_hub):
    """An adapter whose base model, a prompts-only checkpoint whose backbone, and a model that are uncached hub ids:
    one line each, in seconds, with HF_HUB_OFFLINE unset."""
    from st_prompts import save_prompts_only

    adapter, checkpoint, uncached = tmp_path / "adapter", tmp_path / "prompts", "st-prompts-tests/not-cached-anywhere"
    st_model(tiny_bert, max_seq_length=32).save(str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": "st-prompts-tests/uncached-base", "r": 8,
        "target_modules": ["query"]}))
    save_prompts_only(prompted_model(tiny_bert, "cls", prefix_length=2), str(checkpoint))
    edit_json(checkpoint / "sentence_bert_config.json", lambda config: {**config, "backbone_name_or_path": uncached})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT=silent_hub, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"),
               TQDM_DISABLE="1")
    senteval = ["--metrics", "sts", "--tasks", "STSBenchmark", "--senteval-dir", str(SENTEVAL), "--no-progress"]
    commands = [["evaluate", str(adapter), *senteval], ["evaluate", uncached, *senteval],
                ["evaluate", str(checkpoint), *senteval], ["index", "build", str(checkpoint), str(CORPUS),
                                                           str(tmp_path / "idx")]]
    result = subprocess.run([sys.executable, "-c", SILENT_DRIVER, json.dumps(commands)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for argv, line in zip(commands, result.stdout.strip().splitlines(), strict=True):
        answer = json.loads(line)
        assert answer["status"] == 2, answer
        error = one_error_line(answer["err"], alone=argv[1] != str(adapter))
        assert "cannot be reached" in error, answer
        assert argv[1] == str(adapter) or ("not-cached-anywhere" in error and "Hugging Face cache" in error), error
        bound = 90 if argv[1] == str(adapter) else 20  # the probe waits 5 s
        assert answer["took"] < bound, f"{argv[:2]}: {answer['took']:.0f} s"
    assert not (tmp_path / "idx").exists()
