"""300 stalled clients against `st-prompts serve`: file descriptors, time until dropped, SIGTERM time (run by hand:
``python benchmarks/serving_hardening.py minilm``; the numbers in docs/serving.md)."""
import os, signal, socket, subprocess, sys, time

args = sys.argv[1:] or ["minilm"]
env = {**os.environ, "HF_HUB_OFFLINE": "1"}
proc = subprocess.Popen([sys.executable, "-m", "st_prompts.cli", "serve", *args, "--port", "0"],
                        stderr=subprocess.PIPE, text=True, env=env)
t0 = time.monotonic()
for line in proc.stderr:
    if "listening on http://" in line:
        print(f"ready after {time.monotonic() - t0:.0f} s", flush=True)
        host, port = line.split("listening on http://", 1)[1].split()[0].rsplit(":", 1)
        break
fds = lambda: len(os.listdir(f"/proc/{proc.pid}/fd"))
HALF = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Ty"


def stall(n, data=HALF):
    out = []
    for _ in range(n):
        s = socket.create_connection((host, int(port)))
        s.sendall(data)
        s.setblocking(False)
        out.append(s)
    return out


def wait_closed(socks, limit):
    start, open_ = time.monotonic(), set(socks)
    while open_ and time.monotonic() - start < limit:
        for s in list(open_):
            try:
                if s.recv(65536) == b"":
                    open_.discard(s)
            except BlockingIOError:
                pass
            except ConnectionResetError:
                open_.discard(s)
        time.sleep(0.05)
    return time.monotonic() - start, len(open_)


before = fds()
socks = stall(300)
time.sleep(0.5)
held = fds()
seconds, left = wait_closed(socks, 60)
time.sleep(0.5)
print(flush=True)
print(f"300 half-header clients: fds {before} -> {held} -> {fds()}; all dropped after {seconds:.1f} s "
      f"({left} still open after 60 s)")
for s in socks:
    s.close()
socks = stall(300) + stall(1, b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{") + stall(1, b"")
time.sleep(0.5)
start = time.monotonic()
proc.send_signal(signal.SIGTERM)
tail = []
for line in proc.stderr:
    tail.append(line.rstrip())
    if "stopped after" in line:
        break
stopped = time.monotonic() - start
code = proc.wait(120)
print(f"SIGTERM with 302 stalled clients open: stopped after {stopped:.1f} s, process gone after "
      f"{time.monotonic() - start:.1f} s, exit status {code}; tracebacks in the log: "
      f"{sum('Traceback' in l for l in tail + proc.stderr.read().splitlines())}")
