#!/usr/bin/env bash
# The wheels `st-prompts serve` needs on the lent GPU machine, whose image (torch, transformers, sentence-transformers,
# aiohttp, prometheus-client, uvloop) lacks them and which reaches no registry: run here, then carry
# benchmarks/.wheels (ignored by git) with the working tree and install them there (benchmarks/gpu.py's docstring).
#
#   bash benchmarks/gpu_wheels.sh            # download into benchmarks/.wheels (CPython 3.12, manylinux x86_64),
#                                            # with MiniLM's tokenizer files in .wheels/minilm-tokenizer
#   bash benchmarks/gpu_wheels.sh install    # on the device: install, without dependencies, each wheel whose
#                                            # distribution is missing or older (the image's newer ones are kept);
#                                            # without pip, unpack them into .wheels/site (gpu.py puts it on the path)
#
# Not downloaded: datasets (and pyarrow, pandas, dill, multiprocess, xxhash): sentence-transformers 6 imports it only
# where it is installed, and st_prompts imports it only to train, read data and build indexes, never on the path of
# `serve BANK` or `encode`; nor do faiss, matplotlib or pandas (`gpu.py --smoke` passed with sentence-transformers 6.0.1,
# the image's, and all of these hidden from it and its servers); pyarrow alone is ~40 MB.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
wheels="$here/.wheels"
python="${PYTHON:-python}"

if [[ "${1:-download}" == "install" ]]; then
    missing=$("$python" - "$wheels" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    from packaging.version import Version
except ImportError:  # a bare interpreter: the release numbers
    import re

    def Version(text):  # noqa: N802
        return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:4])

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, wanted = wheel.name.split("-")[:2]
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have is not None and Version(have) >= Version(wanted):
        print(f"keep {name} {have}", file=sys.stderr)
    else:
        print(wheel)
PY
)
    if [[ -n "$missing" ]] && "$python" -m pip --version > /dev/null 2>&1; then
        # shellcheck disable=SC2086  # one path per line, no spaces
        "$python" -m pip install --no-index --no-deps --quiet $missing
        echo "installed: $(echo $missing | xargs -n1 basename | tr '\n' ' ')"
    elif [[ -n "$missing" ]]; then  # no pip: unpacked into .wheels/site, which benchmarks/gpu.py puts on the path
        # shellcheck disable=SC2086
        "$python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$wheels/site" $missing
        echo "no pip: unpacked into $wheels/site (benchmarks/gpu.py adds it to the path): $(echo $missing | xargs -n1 basename | tr '\n' ' ')"
    else
        echo "nothing to install"
    fi
    exit 0
fi

mkdir -p "$wheels"
# the serve extra (pyproject.toml) less what the image has, and what starlette and uvicorn need (kept where the
# image already has them: `install` skips those)
"$python" -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --no-deps -d "$wheels" --quiet 2> >(grep -v "is ignored: it is neither" >&2) \
    "starlette>=0.40" "uvicorn>=0.30" "httptools>=0.6" "orjson>=3.9" anyio sniffio h11 click idna typing_extensions
# the packaged MiniLM's tokenizer files, which gpu.py's random backbone uses (the image lacks the package)
mkdir -p "$wheels/minilm-tokenizer"
(cd "$here" && "$python" -c 'import shutil, sys; from pathlib import Path; from st_prompts.utils import packaged_minilm_path
from gpu import TOKENIZER_FILES
for name in TOKENIZER_FILES:
    shutil.copy(Path(packaged_minilm_path()) / name, sys.argv[1])' "$wheels/minilm-tokenizer")
ls -1 "$wheels"
du -sh "$wheels"
