"""``st-prompts embed``: ``--engine local`` against ``--engine ray`` on the same CPUs, and a two-node Ray cluster.

Run by hand (not part of the test suite)::

    python benchmarks/embed.py --data-dir ../shared/data
    python benchmarks/embed.py --data-dir ../shared/data --rows 4000 --rounds 5 --skip-cluster

* Corpus: the first ``--rows`` Wikipedia sentences of ``train/wiki_sentences.txt``, as a text file; model: the
  packaged all-MiniLM-L6-v2 (fp32); parts of ``--part-rows`` rows; batch size 64.
* Part 1, one machine: local = this process, ``torch.set_num_threads(CPUS)``; ray = a local Ray of ``num_cpus=CPUS``
  started once before the rounds (its start reported apart), ``CPUS`` actors of one CPU (one torch thread) each. A
  warm-up run of each engine, then ``--rounds`` rounds that alternate which engine goes first, each run into a new
  folder; every run's vectors are checked against the warm-up local run's. Reported per engine: sentences a second
  end to end (the ``embed_file`` call: model loads included, for Ray the actors' start and model loads too) and
  in steady state (local: after its model loaded; ray: from the moment the last actor had its model loaded).
* Part 2, a cluster: ``ray start --head --num-cpus 1`` and ``ray start --address HEAD --num-cpus 1`` (a second node on
  this machine), then ``st-prompts embed ... --engine ray --ray-address HEAD``; the part records say which node
  encoded each part. Both nodes are stopped afterwards (by the process ids of this cluster only: other programs on
  this machine may run their own Ray).

Results go to ``OUT_DIR/embed.json`` and ``OUT_DIR/embed.md`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no weight-loading bars between the rounds' lines
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import REPO, default_data_dir, run_environment  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=default_data_dir())
    parser.add_argument("--rows", type=int, default=4000, help="sentences a run (default 4000)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up (default 5)")
    parser.add_argument("--part-rows", type=int, default=500, help="rows a part (default 500)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs both engines use (default 2)")
    parser.add_argument("--cluster-rows", type=int, default=2000, help="sentences of the cluster run (default 2000)")
    parser.add_argument("--skip-cluster", action="store_true", help="no two-node cluster run")
    parser.add_argument("--skip-in-process", action="store_true", help="no in-process rounds (embed_file calls)")
    parser.add_argument("--skip-commands", action="store_true", help="no rounds of the command as fresh processes")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    return parser.parse_args(argv)


def read_vectors(folder: Path) -> tuple[list, np.ndarray]:
    from st_prompts.search.embedding_files import EmbeddingFiles

    ids, vectors = [], []
    for batch_ids, _, batch_vectors in EmbeddingFiles.open([folder]).batches(texts=False):
        ids += batch_ids
        vectors.append(batch_vectors)
    return ids, np.concatenate(vectors)


def part_records(folder: Path) -> list[dict]:
    from st_prompts.search.embedding_files import part_record

    return [part_record(p) for p in sorted(folder.glob("part-*.parquet"))]


def nodes_of(records: list[dict]) -> dict[str, int]:
    """node id -> parts it encoded (a part split between actors counts for each)."""
    counts: dict[str, int] = {}
    for record in records:
        by = record["encoded_by"]
        for node in {b.get("node_id") or b.get("node") for b in [by, *by.get("also", [])]}:
            counts[node] = counts.get(node, 0) + 1
    return counts


def one_run(engine: str, corpus: Path, work: Path, args, cpus: int) -> dict:
    from st_prompts.embedding import RayOptions, embed_file

    out = Path(tempfile.mkdtemp(dir=work, prefix=f"{engine}-"))
    shutil.rmtree(out)
    start = time.perf_counter()
    result = embed_file("minilm", corpus, out, part_rows=args.part_rows, batch_size=64, engine=engine,
                        ray=RayOptions(actors=cpus, num_cpus=1) if engine == "ray" else None)
    wall = time.perf_counter() - start
    ended = time.time()
    records = part_records(out)
    if engine == "ray":  # steady state: from the actors' model loads to the end (first and last: two bounds)
        ready = [b["ready"] for r in records for b in [r["encoded_by"], *r["encoded_by"].get("also", [])]]
        steady, steady_first = ended - max(ready), ended - min(ready)
    else:
        steady = steady_first = result.seconds
    ids, vectors = read_vectors(out)
    shutil.rmtree(out)
    return {"engine": engine, "rows": result.rows, "wall_s": round(wall, 3), "steady_s": round(steady, 3),
            "rate_end_to_end": round(result.rows / wall, 2), "rate_steady": round(result.rows / steady, 2),
            "rate_steady_from_first_actor": round(result.rows / steady_first, 2),
            "actors": len({(b.get("node_id"), b.get("pid")) for r in records
                           for b in [r["encoded_by"], *r["encoded_by"].get("also", [])]}),
            "load_average": [round(x, 2) for x in os.getloadavg()], "ids": ids, "vectors": vectors}


def part_one(args, corpus: Path, work: Path) -> dict:
    import ray
    import torch

    torch.set_num_threads(args.cpus)
    clock = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray_start = time.perf_counter() - clock
    try:
        warm = {engine: one_run(engine, corpus, work, args, args.cpus) for engine in ("local", "ray")}
        reference_ids, reference = warm["local"]["ids"], warm["local"]["vectors"]
        rounds = []
        for number in range(args.rounds):
            order = ("local", "ray") if number % 2 == 0 else ("ray", "local")
            for engine in order:
                run = one_run(engine, corpus, work, args, args.cpus)
                assert run["ids"] == reference_ids, f"{engine}: other ids"
                diff = float(np.max(np.abs(run.pop("vectors") - reference)))
                assert diff < 1e-5, f"{engine}: vectors differ by {diff}"
                run.pop("ids")
                rounds.append({"round": number, **run, "max_abs_diff_vs_local_warmup": diff})
                print(json.dumps(rounds[-1]), flush=True)
        warm_diff = float(np.max(np.abs(warm["ray"]["vectors"] - reference)))
    finally:
        ray.shutdown()
    summary = {}
    for engine in ("local", "ray"):
        mine = [r for r in rounds if r["engine"] == engine]
        summary[engine] = {key: round(statistics.median(r[key] for r in mine), 2)
                           for key in ("rate_end_to_end", "rate_steady", "rate_steady_from_first_actor", "wall_s",
                                       "steady_s")}
    ratios = {key: [round(ray_run[key] / local_run[key], 3) for local_run, ray_run in zip(
        [r for r in rounds if r["engine"] == "local"], [r for r in rounds if r["engine"] == "ray"])]
        for key in ("rate_end_to_end", "rate_steady", "rate_steady_from_first_actor")}
    return {"ray_start_s": round(ray_start, 2), "warmup_ray_vs_local_max_abs_diff": warm_diff, "rounds": rounds,
            "median": summary, "ratio_ray_over_local_per_round": ratios,
            "ratio_ray_over_local_median": {k: round(statistics.median(v), 3) for k, v in ratios.items()}}


def _ray_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token"}  # `ray start`'s default since 2.59


def part_commands(args, corpus: Path, work: Path) -> dict:
    """The command as a user runs it: each run a fresh ``st-prompts embed`` process (its imports and model loads
    counted for both engines); ray joins a local Ray of ``--cpus`` CPUs started once beforehand (an existing cluster:
    ``--ray-address``)."""
    import ray

    temp = tempfile.mkdtemp(prefix="rayemb-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    env = _ray_env()
    head = f"{ray.util.get_node_ip_address()}:6392"
    start = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", str(args.cpus), "--port",
             "6392", "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"]
    base = [sys.executable, "-m", "st_prompts.cli", "embed", "minilm", str(corpus), "OUT", "--part-rows",
            str(args.part_rows), "--batch-size", "64", "--no-progress"]
    extra = {"local": [], "ray": ["--engine", "ray", "--ray-address", head, "--actors", str(args.cpus),
                                  "--num-cpus", "1"]}
    log: dict = {"ray_start_command": "ray " + " ".join(start[1:]),
                 "commands": {engine: "st-prompts " + " ".join(base[3:] + extra[engine]) for engine in extra}}

    def run(engine: str) -> dict:
        out = Path(tempfile.mkdtemp(dir=work, prefix=f"cli-{engine}-")) / "out"
        command = [str(out) if arg == "OUT" else arg for arg in base] + extra[engine]
        clock = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - clock
        if done.returncode != 0:
            raise RuntimeError(f"{engine}: exit {done.returncode}: {done.stderr[-2000:]}")
        ids, vectors = read_vectors(out)
        shutil.rmtree(out.parent)
        return {"engine": engine, "wall_s": round(wall, 3), "rate": round(len(ids) / wall, 2),
                "printed": done.stdout.strip().splitlines()[-1][-300:],
                "load_average": [round(x, 2) for x in os.getloadavg()], "ids": ids, "vectors": vectors}

    try:
        clock = time.perf_counter()
        done = subprocess.run(start, env=env, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed: {done.stderr[-2000:]}")
        log["ray_start_s"] = round(time.perf_counter() - clock, 2)
        warm = {engine: run(engine) for engine in ("local", "ray")}
        reference_ids, reference = warm["local"]["ids"], warm["local"]["vectors"]
        rounds = []
        for number in range(args.rounds):
            for engine in (("local", "ray") if number % 2 == 0 else ("ray", "local")):
                entry = run(engine)
                assert entry.pop("ids") == reference_ids, f"{engine}: other ids"
                diff = float(np.max(np.abs(entry.pop("vectors") - reference)))
                assert diff < 1e-5, f"{engine}: vectors differ by {diff}"
                rounds.append({"round": number, **entry, "max_abs_diff_vs_local_warmup": diff})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        log["left_running_after_stop"] = _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)
    ratios = [round(r["rate"] / l["rate"], 3) for l, r in zip(  # noqa: E741
        [r for r in rounds if r["engine"] == "local"], [r for r in rounds if r["engine"] == "ray"])]
    return {**log, "rounds": rounds, "median_rate": {engine: round(statistics.median(
        r["rate"] for r in rounds if r["engine"] == engine), 2) for engine in ("local", "ray")},
        "median_wall_s": {engine: round(statistics.median(
            r["wall_s"] for r in rounds if r["engine"] == engine), 2) for engine in ("local", "ray")},
        "ratio_ray_over_local_per_round": ratios, "ratio_ray_over_local_median": round(statistics.median(ratios), 3)}


def _cluster_pids(marker: str) -> list[int]:
    """Processes whose command line names this cluster's own temp folder: this cluster's, nobody else's."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return [pid for pid in pids if pid != os.getpid()]


def _stop_cluster(marker: str) -> list[int]:
    pids = _cluster_pids(marker)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(3)
        pids = _cluster_pids(marker)
        if not pids:
            break
    return _cluster_pids(marker)


def part_two(args, sentences: list[str], work: Path) -> dict:
    import ray

    corpus = work / "cluster.txt"
    corpus.write_text("\n".join(sentences[:args.cluster_rows]) + "\n", encoding="utf-8")
    temp = tempfile.mkdtemp(prefix="rayemb-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    env = _ray_env()
    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = 6391
    ip = ray.util.get_node_ip_address()
    head = f"{ip}:{port}"
    commands = [[ray_bin, "start", "--head", "--num-cpus", "1", "--port", str(port), "--include-dashboard=false",
                 f"--temp-dir={temp}", "--disable-usage-stats"],
                [ray_bin, "start", "--address", head, "--num-cpus", "1", "--disable-usage-stats"]]
    out = work / "cluster.emb"
    log = {"head": head, "commands": [" ".join(c[1:]) for c in commands]}
    try:
        for command in commands:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command[1:])} failed: {done.stderr[-2000:]}")
        embed = [sys.executable, "-m", "st_prompts.cli", "embed", "minilm", str(corpus), str(out), "--engine", "ray",
                 "--ray-address", head, "--num-cpus", "1", "--part-rows", "200", "--no-progress"]
        log["embed_command"] = "st-prompts " + " ".join(embed[3:])
        clock = time.perf_counter()
        done = subprocess.run(embed, env=env, capture_output=True, text=True, timeout=900)
        log["embed_wall_s"] = round(time.perf_counter() - clock, 2)
        log["embed_exit"] = done.returncode
        log["embed_stdout"] = done.stdout.strip()[-1000:]
        log["embed_stderr_tail"] = done.stderr.strip()[-1000:]
        log["load_average"] = [round(x, 2) for x in os.getloadavg()]
        records = part_records(out) if done.returncode == 0 else []
        log["parts"] = [{"part": r["part"], "rows": r["rows"], "node_id": r["encoded_by"]["node_id"],
                         "pid": r["encoded_by"]["pid"], "also": [b["node_id"] for b in r["encoded_by"].get("also", [])]}
                        for r in records]
        log["nodes"] = nodes_of(records)
        if records:
            ids, vectors = read_vectors(out)
            from st_prompts.loading import load_sentence_model

            model = load_sentence_model("minilm", device="cpu")
            texts = corpus.read_text(encoding="utf-8").splitlines()
            log["max_abs_diff_vs_encode_document"] = float(np.max(np.abs(
                vectors - model.encode_document([texts[i - 1] for i in ids], batch_size=64))))
    finally:
        log["left_running_after_stop"] = _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)
    return log


def markdown(result: dict) -> str:
    env = result["environment"]
    settings = result["settings"]
    lines = ["# `st-prompts embed`: local against Ray", "",
             f"Command: `{result['command']}`. Machine: {env['device']}, {env['cpus']} CPUs "
             f"({env['cpu_instructions']}), shared with other jobs. Versions: "
             + ", ".join(f"{k} {v}" for k, v in {**env['versions'], **result['more_versions']}.items() if v) + ".",
             "", f"Corpus: {settings['rows']} Wikipedia sentences; the packaged MiniLM, fp32; parts of "
             f"{settings['part_rows']} rows, batches of 64; {settings['cpus']} CPUs. Ray: {settings['cpus']} actors "
             "of 1 CPU (1 torch thread) each; the driver loads no model. Rounds alternate which engine goes first, "
             "after a warm-up run of each; every run's vectors are checked against the warm-up local run's (the "
             "largest difference in the tables)."]
    cli = result.get("commands")
    if cli:
        lines += ["", "## The command, a fresh process a run", "",
                  "Each run is `st-prompts embed` in a new process, so both engines pay their imports and model loads; "
                  f"ray joins a local Ray of {settings['cpus']} CPUs started once before the rounds (`--ray-address`; "
                  f"`{cli['ray_start_command']}`: {cli['ray_start_s']} s, not counted).", "",
                  *[f"* {engine}: `{command}`" for engine, command in cli["commands"].items()], "",
                  "| round | engine | wall (s) | sent./s | max abs diff | load (1 min) | the command's last line |",
                  "|---|---|---|---|---|---|---|"]
        for run in cli["rounds"]:
            lines.append(f"| {run['round']} | {run['engine']} | {run['wall_s']} | {run['rate']} | "
                         f"{run['max_abs_diff_vs_local_warmup']:.1e} | {run['load_average'][0]} | "
                         f"{run['printed'].split('; ', 1)[-1]} |")
        lines += ["", f"Median wall: local {cli['median_wall_s']['local']} s, ray {cli['median_wall_s']['ray']} s. "
                  f"Ray / local sentences a second, per round: {cli['ratio_ray_over_local_per_round']}; median "
                  f"**{cli['ratio_ray_over_local_median']}** (goal: >= 0.85). Processes of that Ray left after it "
                  f"was stopped: {cli['left_running_after_stop']}."]
    one = result.get("one_machine")
    if one:
        lines += ["", "## In one process: `embed_file` calls", "",
                  f"local: the benchmark's process, {settings['cpus']} torch threads, torch and the model's code "
                  f"imported once for all rounds. ray: a local Ray of {settings['cpus']} CPUs started once (in "
                  f"{one['ray_start_s']} s, not counted), whose actors start afresh each run: a worker process each, "
                  "importing torch and sentence-transformers and loading the model, which local never pays again.",
                  "", "| round | engine | end to end (sent./s) | steady, last actor (sent./s) | steady, first actor | "
                  "wall (s) | max abs diff | load (1 min) |", "|---|---|---|---|---|---|---|---|"]
        for run in one["rounds"]:
            lines.append(f"| {run['round']} | {run['engine']} | {run['rate_end_to_end']} | {run['rate_steady']} | "
                         f"{run['rate_steady_from_first_actor']} | {run['wall_s']} | "
                         f"{run['max_abs_diff_vs_local_warmup']:.1e} | {run['load_average'][0]} |")
        median = one["median"]
        ratio = one["ratio_ray_over_local_median"]
        lines += ["", f"Median: local {median['local']['rate_end_to_end']} sent./s end to end, "
                  f"{median['local']['rate_steady']} steady; ray {median['ray']['rate_end_to_end']} end to end, "
                  f"{median['ray']['rate_steady']} steady. Ray / local (median of the rounds' ratios): "
                  f"**{ratio['rate_end_to_end']}** end to end (the actors' start and model loads counted), "
                  f"**{ratio['rate_steady']}** in steady state counted from the last actor's model load (an upper "
                  f"bound: the first actor encoded before it), **{ratio['rate_steady_from_first_actor']}** counted "
                  "from the first actor's (a lower bound: the second was still loading).", "",
                  "End to end: the `embed_file` call. Steady: local from after its model load, ray from the moment "
                  "the first / the last actor had loaded its model."]
    cluster = result.get("cluster")
    if cluster:
        lines += ["", "## Two Ray nodes on this machine", "",
                  "```", *[f"ray {c}" for c in cluster["commands"]], cluster.get("embed_command", ""), "```", "",
                  f"Exit {cluster.get('embed_exit')}: {cluster.get('embed_stdout', '')}", "",
                  f"Parts per node (from the part records' `encoded_by`): {cluster.get('nodes')}; vectors against "
                  f"`encode_document`: max abs diff {cluster.get('max_abs_diff_vs_encode_document')}. Load "
                  f"{cluster.get('load_average')}. Both nodes stopped afterwards; processes left: "
                  f"{cluster.get('left_running_after_stop')}.", "",
                  "| part | rows | node | actor pid |", "|---|---|---|---|"]
        lines += [f"| {p['part']} | {p['rows']} | {p['node_id'][:12]}... | {p['pid']} |" for p in cluster["parts"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.data_dir is None or not (args.data_dir / "train" / "wiki_sentences.txt").is_file():
        print("benchmarks/embed.py: error: --data-dir must hold train/wiki_sentences.txt", file=sys.stderr)
        return 2
    from importlib.metadata import version

    lines = (args.data_dir / "train" / "wiki_sentences.txt").read_text(encoding="utf-8").splitlines()
    sentences = [line.strip() for line in lines if line.strip()]
    work = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    try:
        corpus = work / "corpus.txt"
        corpus.write_text("\n".join(sentences[:args.rows]) + "\n", encoding="utf-8")
        result = {"command": "python benchmarks/embed.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "settings": {"rows": args.rows, "rounds": args.rounds, "part_rows": args.part_rows,
                               "cpus": args.cpus, "cluster_rows": args.cluster_rows, "batch_size": 64},
                  "more_versions": {name: version(name) for name in ("ray", "pyarrow")},
                  "environment_at_start": run_environment()}
        if not args.skip_commands:
            result["commands"] = part_commands(args, corpus, work)
        if not args.skip_in_process:
            result["one_machine"] = part_one(args, corpus, work)
        if not args.skip_cluster:
            result["cluster"] = part_two(args, sentences, work)
        result["environment"] = run_environment()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "embed.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out_dir / "embed.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
