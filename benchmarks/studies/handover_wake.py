"""What the control loop's hand-over costs: `SimpleQueue.put` at 30 Hz with a consumer thread waiting on it or polling it.

    python -m benchmarks.studies.handover_wake wait|poll any|other|same

`wait`: the consumer blocks in `get` (as the client's publisher thread does), so every `put` wakes it
(a futex wake). `poll`: the consumer checks every 0.5 ms and is never waiting, so `put` wakes nobody.
`other`/`same`: the consumer pinned to CPU 1 / the putting thread's CPU 0; `any`: no pinning.
Prints the put's p50/p99/max and the putting thread's context switches during its puts
(docs/benchmarks.md, "The fast path", hand-over).
"""

import os
import queue
import sys
import threading
import time
import numpy as np

mode = sys.argv[1]  # wait | poll
cpus = sys.argv[2]  # same | other | any
N = 300
q = queue.SimpleQueue()
stop = False


def consumer():
    if cpus == "same":
        os.sched_setaffinity(0, {0})
    elif cpus == "other":
        os.sched_setaffinity(0, {1})
    while not stop:
        if mode == "wait":
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                pass
        else:
            try:
                q.get_nowait()
            except queue.Empty:
                time.sleep(0.0005)


t = threading.Thread(target=consumer, daemon=True)
t.start()
if cpus in ("same", "other"):
    os.sched_setaffinity(0, {0})
time.sleep(0.2)
d = []


def ctx():
    f = open(f"/proc/self/task/{threading.get_native_id()}/status").read()
    return int(f.split("voluntary_ctxt_switches:")[1].split()[0]), int(
        f.split("nonvoluntary_ctxt_switches:")[1].split()[0]
    )


inv = 0
for i in range(N):
    time.sleep(1 / 30)
    c0 = ctx()
    t0 = time.perf_counter()
    q.put(i)
    t1 = time.perf_counter()
    c1 = ctx()
    d.append((t1 - t0) * 1e6)
    inv += (c1[1] - c0[1]) + (c1[0] - c0[0])
stop = True
d = np.array(d)
print(
    f"{mode:>4} consumer, {cpus:>5} cpu: put us p50 {np.median(d):6.1f} p99 {np.percentile(d, 99):6.1f} max {d.max():7.1f}  (context switches of the putting thread during puts: {inv})"
)
