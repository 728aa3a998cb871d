"""A/B of two source trees of st_prompts serving one bank (run by hand): ``st-prompts serve BANK --threads 2
--max-batch-rows 32`` of each tree in turn (order alternating per round), closed-loop clients of 1-16 Wikipedia
sentences with a random task of 8, a warm-up of a third of the window, ``/metrics`` before and after (rows and padded
tokens per pass). The bank is the one ``benchmarks/serving.py`` builds (``--work``/bank-8).

    python benchmarks/serving_ab.py OLD_TREE NEW_TREE ROUNDS SECONDS 1,16,64 --data-dir ../shared/data

e.g. OLD_TREE a ``git worktree add /tmp/oldtree HEAD~1``. Prints one line per run and the per-round ratios.
"""
import asyncio, json, os, random, re, signal, subprocess, sys, time, urllib.request
old_tree, new_tree = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]); seconds = float(sys.argv[4]); concs = [int(c) for c in sys.argv[5].split(",")]
data = sys.argv[sys.argv.index("--data-dir") + 1] if "--data-dir" in sys.argv else "../shared/data"
bank = sys.argv[sys.argv.index("--bank") + 1] if "--bank" in sys.argv else "/tmp/st-prompts-serving-bench/bank-8"
lines = open(os.path.join(data, "train", "wiki_sentences.txt")).read().splitlines()
rng = random.Random(0)
pool = [(f"t{rng.randrange(8)}", rng.sample(lines, rng.randint(1, 16))) for _ in range(256)]
variants = {"old": old_tree, "new": new_tree}
def metrics(port):
    out = {}
    for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        m = re.match(r"(st_prompts_batch_[a-z_]+?(_sum|_count))(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and not m.group(3): out[m.group(1)] = float(m.group(4))
    return out
async def post(reader, writer, task, texts):
    body = json.dumps({"model": task, "input": texts, "encoding_format": "base64"}).encode()
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    await reader.readexactly(n)
    assert head.startswith(b"HTTP/1.1 200"), head
async def load(port, conc, secs):
    done = [0, 0]; lat = []
    end = time.monotonic() + secs
    async def worker(i):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        j = i
        while time.monotonic() < end:
            task, texts = pool[j % len(pool)]; j += conc
            t = time.monotonic(); await post(r, w, task, texts); lat.append(time.monotonic() - t)
            done[0] += 1; done[1] += len(texts)
        w.close()
    t0 = time.monotonic()
    await asyncio.gather(*(worker(i) for i in range(conc)))
    lat.sort()
    return done[1] / (time.monotonic() - t0), lat[int(0.99 * (len(lat) - 1))] if lat else 0, done[0]
results = {}
for rnd in range(rounds):
    for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
        env = dict(os.environ, PYTHONPATH=variants[name])
        port = 18000 + rnd * 2 + (name == "new")
        proc = subprocess.Popen([sys.executable, "-m", "st_prompts.cli", "serve", bank,
                                 "--port", str(port), "--threads", "2", "--max-batch-rows", "32"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/tmp")
        for line in proc.stdout:
            if "costs as much as" in line: print(name, line.strip().split("] ")[-1][:90], flush=True)
            if "listening on" in line: break
        for conc in concs:
            asyncio.run(load(port, conc, max(5, seconds / 3)))  # warm-up
            m0 = metrics(port)
            rate, p99, n = asyncio.run(load(port, conc, seconds))
            m1 = metrics(port)
            d = {k: m1[k] - m0.get(k, 0) for k in m1}
            rows = d.get("st_prompts_batch_rows_sum", 0); passes = d.get("st_prompts_batch_rows_count", 1)
            padded = d.get("st_prompts_batch_padded_tokens_sum", 0)
            results.setdefault((name, conc), []).append(rate)
            print(f"round {rnd} {name} c={conc:2d}: {rate:6.1f} sentences/s p99 {p99:5.2f} s ({n} requests) "
                  f"rows/pass {rows / max(passes, 1):4.1f} padded/row {padded / max(rows, 1):4.1f}", flush=True)
        proc.send_signal(signal.SIGTERM); proc.wait(60)
for conc in concs:
    o, n = results[("old", conc)], results[("new", conc)]
    print(f"c={conc}: new/old per round " + " ".join(f"{b / a:.2f}" for a, b in zip(o, n)))
