"""Actions and language from one pi0.5 (OxyGen): shared prefill and cross-frame batching, per frame.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python -m benchmarks.studies.language [--shapes tiny,small] [--robots 1,4,8]
        [--frames 8] [--tokens 20] [--per-frame 5] [--vlm-robots 1,2,4,8,16] [--device cpu --dtype float32]

Needs only lerobot, torch, transformers, tokenizers and numpy (no Zenoh): it times the runners the
server calls, on checkpoints built offline with random weights (`--shapes`: the builder's ``tiny`` and
``small`` pi05 presets, one 96x128 camera; the small one's prefix is 256 image + 200 task tokens).

Workload: R robots each send an observation every frame (System 1: a chunk every frame); robot j also
asks for N = `--tokens` tokens of text (System 2) every M = ceil(N / k) frames, staggered (frame f
asks robots with (f + j) % M == 0), k = `--per-frame`. Every mode does the same work:

1. actions alone: one batched call for the R chunks;
2. isolated (two components today): the chunks, then each asking robot's text on its own: a separate
   prefill and N greedy tokens, one generation at a time;
3. shared prefill: the chunks and the asking robots' prefix caches from one call, their N tokens
   decoded within the frame (the frame's askers together);
4. shared + cross-frame batching: the same call, then one `advance`: every robot's unfinished text
   decodes k tokens in one batch per step, across frames (the runner's `language.tokens_per_frame`);
4s. as 4 with the decode budget tied to an action SLO (`--slo-factor` x the actions-alone p50).

`--served`: only the served-loop table instead. The server's inference loop over the runner in real
time (batches of waiting observations, then text as server/engine/serving.py decodes it), 16 robots (at
`--served-fps`) asking actions and text (tasks of ~190 tokens) and one honest robot asking actions
only, each driven as the reference client drives it; side by side in one run: the same fleet
without text, with text, and with text under `--served-slo-ms`. Reported: the honest robot's empty
ticks and p99 latency, every robot's action latency p50/p99, text tokens/s.

Per mode: frame latency p50/p99 (whole frame), action latency p50/p99 (frame start to chunks out;
text comes after), action rate (chunks/s), text tokens/s; then the ratios. `--vlm-robots`: the VLM
runner's text generation for B robots batched (iteration-level) vs one at a time, tokens identical.
Timings on a shared machine vary; ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.robot import SimulatedRobot

TASKS = ("pick up the red cube", "open the drawer", "fold the towel on the table", "push the block left")
CAMERAS = {"front": (96, 128)}
NAMES = [f"joint_{i}" for i in range(6)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def build(root: Path, shape: str) -> Path:
    from lerobot_zenoh.checkpoint_builder.build import build_checkpoint

    folder = root / f"pi05_{shape}"
    if not (folder / "config.json").is_file():
        build_checkpoint(folder, policy_type="pi05", state_names=NAMES, action_names=NAMES, cameras=CAMERAS,
                         chunk_size=50, fps=30, architecture=shape, force=True)
    return folder


def load(folder: Path, device: str, dtype: str):
    from lerobot_zenoh.server.runners.lerobot import LoadOptions, read_config
    from lerobot_zenoh.server.runners.pi05_language import Pi05LanguageRunner

    return Pi05LanguageRunner.from_checkpoint(folder, read_config(folder), LoadOptions(device=device, dtype=dtype))


def observations(robots: int, frame: int) -> list:
    rng = np.random.default_rng(1000 * frame + robots)
    return [(rng.normal(size=6).astype(np.float32),
             {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in CAMERAS.items()},
             TASKS[j % len(TASKS)]) for j in range(robots)]


def request(j: int, frame: int, obs, *, text: bool = False, actions: bool = True, tokens: int = 0):
    from lerobot_zenoh.server.runners.base import InferenceRequest
    from lerobot_zenoh.server.runners.pi05_language import LANGUAGE_EXTRA, LanguageQuery

    state, images, task = obs
    extras = {LANGUAGE_EXTRA: LanguageQuery(max_new_tokens=tokens, tag=frame, actions=actions)} if text else {}
    return InferenceRequest(f"robot{j}", state, images, task, seed=frame * 97 + j, extras=extras)


class Mode:
    """One mode's frames on its own runner (modes keep text state across frames), stepped one frame at
    a time so that the modes' frames interleave and share whatever load the machine has."""

    def __init__(self, runner, mode: str, robots: int, n: int, k: int, slo_ms: float | None):
        from lerobot_zenoh.server.runners.pi05_language import LanguageSettings

        self.runner, self.mode, self.robots, self.n = runner, mode, robots, n
        self.every = math.ceil(n / k)
        runner.configure_language(LanguageSettings(
            max_new_tokens=n, tokens_per_frame=k if mode.startswith("4") else n, min_tokens_per_frame=1,
            max_requests=64, action_slo_ms=slo_ms if mode == "4s" else None))
        for j in range(robots):
            runner.forget(f"robot{j}")
        self.counters0 = dict(runner.counters)
        self.frame_ms: list[float] = []
        self.action_ms: list[float] = []
        self.tokens = 0
        self.total_s = 0.0

    def frame(self, f: int, *, record: bool) -> None:
        runner, n, robots = self.runner, self.n, self.robots
        obs = observations(robots, f)
        asking = [j for j in range(robots) if (f + j) % self.every == 0] if self.mode != "1" else []
        got = 0
        t0 = time.perf_counter()
        if self.mode in ("1", "2"):
            runner.run([request(j, f, obs[j]) for j in range(robots)])
            t_act = time.perf_counter()
            for j in asking:  # today's System 2: its own prefill, then its N tokens, one at a time
                runner.run([request(j, f, obs[j], text=True, actions=False, tokens=n)])
                while runner.language_active:
                    got += sum(u.tokens for u in runner.advance(max_tokens=n) if u.final)
        else:
            runner.run([request(j, f, obs[j], text=j in asking, tokens=n) for j in range(robots)])
            t_act = time.perf_counter()
            before = runner.counters["tokens"]
            if self.mode == "3":
                while runner.language_active:
                    runner.advance(max_tokens=n)
            else:
                runner.advance()
            got = runner.counters["tokens"] - before
        t1 = time.perf_counter()
        if record:
            self.frame_ms.append((t1 - t0) * 1000)
            self.action_ms.append((t_act - t0) * 1000)
            self.tokens += got
            self.total_s += t1 - t0

    def text_mean_ms(self) -> float:
        """Ask to final text: the frames a text spans (ceil(N / k)) times the mean frame."""
        return self.every * statistics.fmean(self.frame_ms)

    def figures(self) -> dict:
        c = self.runner.counters
        return {"frame_p50": pct(self.frame_ms, 50), "frame_p99": pct(self.frame_ms, 99),
                "frame_mean": statistics.fmean(self.frame_ms), "action_p50": pct(self.action_ms, 50),
                "action_p99": pct(self.action_ms, 99), "action_rate": self.robots * len(self.frame_ms) / self.total_s,
                "tokens_s": self.tokens / self.total_s, "busy": c["busy"] - self.counters0["busy"],
                "shrunk": c["budget_shrunk"] - self.counters0["budget_shrunk"]}


def decode_throughput(runner, batch: int, steps: int) -> tuple[float, float]:
    """Tokens/s of `batch` generations decoding `steps` tokens together vs one at a time (same
    prefill caches), the decode phase only."""
    from lerobot_zenoh.server.runners.pi05_language import LanguageSettings

    runner.configure_language(LanguageSettings(max_new_tokens=steps + 1, tokens_per_frame=steps, max_requests=64))
    obs = observations(batch, 999)

    def timed(sessions: list[int]) -> float:
        runner.run([request(j, 0, obs[j], text=True, actions=False, tokens=steps + 1) for j in sessions])
        runner.advance(max_tokens=0)  # the prompt pass (first token), untimed
        t0 = time.perf_counter()
        runner.advance(max_tokens=steps)
        dt = time.perf_counter() - t0
        for j in sessions:
            runner.forget(f"robot{j}")
        return dt

    timed([0])  # warm-up
    together = timed(list(range(batch)))
    alone = sum(timed([j]) for j in range(batch))
    return batch * steps / together, batch * steps / alone


def decode_cost(before: dict, after: dict) -> dict:
    """The profile row's decode cost (docs/pipelines.md) from the runner's counters over a run."""
    d = {k: after[k] - before[k] for k in ("decode_ms", "step_ms", "step_rows", "tokens", "decode_steps")}
    out = {}
    if d["tokens"]:
        out["decode_ms_per_token"] = round(d["decode_ms"] / d["tokens"], 4)
    if d["decode_steps"]:
        out["decode_step_ms"] = round(d["step_ms"] / d["decode_steps"], 4)
        out["decode_batch_mean"] = round(d["step_rows"] / d["decode_steps"], 4)
    return out


def pi05_table(args) -> None:
    root = Path(args.out or tempfile.mkdtemp(prefix="bench_language_"))
    profile: dict = {"hardware": args.hardware, "models": {}}
    for shape in args.shapes.split(","):
        points = []
        folder = build(root, shape)
        # Modes 1-3 finish their text within the frame and share a runner; 4 and 4s keep text across
        # frames (and 4s its own budget): a runner each.
        runners = {"A": load(folder, args.device, args.dtype), "4": load(folder, args.device, args.dtype),
                   "4s": load(folder, args.device, args.dtype)}
        for r in runners.values():
            r.run([request(0, 0, observations(1, 0)[0])])  # warm-up
        print(f"\n## pi05 {shape} ({args.device}, {args.dtype}): N={args.tokens} tokens per text, "
              f"k={args.per_frame} per frame, {args.frames} frames per mode, interleaved", flush=True)
        print(f"{'robots':>6} {'mode':>4} {'frame p50':>9} {'p99':>7} {'action p50':>10} {'p99':>7} "
              f"{'chunks/s':>8} {'tokens/s':>8} {'shrunk':>6}", flush=True)
        for robots in (int(r) for r in args.robots.split(",")):
            # The SLO of 4s: a multiple of the actions-alone latency, measured first.
            probe = Mode(runners["A"], "1", robots, args.tokens, args.per_frame, None)
            for f in range(3):
                probe.frame(f, record=True)
            slo = probe.figures()["action_p50"] * args.slo_factor
            modes = {m: Mode(runners["4" if m == "4" else "4s" if m == "4s" else "A"], m, robots, args.tokens,
                             args.per_frame, slo) for m in ("1", "2", "3", "4", "4s")}
            warm = math.ceil(args.tokens / args.per_frame)
            before = dict(runners["4"].counters)
            for f in range(warm + args.frames):
                for m in ("1", "2", "3"):
                    runners["A"].configure_language(modes[m].runner.settings)
                    modes[m].frame(f, record=f >= warm)
                modes["4"].frame(f, record=f >= warm)
                modes["4s"].frame(f, record=f >= warm)
            rows = {m: mode.figures() for m, mode in modes.items()}
            for m, r in rows.items():
                print(f"{robots:6d} {m:>4} {r['frame_p50']:9.1f} {r['frame_p99']:7.1f} {r['action_p50']:10.1f} "
                      f"{r['action_p99']:7.1f} {r['action_rate']:8.2f} {r['tokens_s']:8.1f} {r['shrunk']:6d}",
                      flush=True)
            print(f"{robots:6d} ratios: frame mean 2->4 {rows['2']['frame_mean'] / rows['4']['frame_mean']:.2f}x, "
                  f"2->3 {rows['2']['frame_mean'] / rows['3']['frame_mean']:.2f}x; tokens/s 4 vs 2 "
                  f"{rows['4']['tokens_s'] / rows['2']['tokens_s']:.2f}x; action p99 4 vs 1 "
                  f"{rows['4']['action_p99'] / rows['1']['action_p99']:.3f}; frame p99 4s vs its SLO ({slo:.0f} ms) "
                  f"{rows['4s']['frame_p99'] / slo:.2f}", flush=True)
            # The combined runner's profile row at this batch (mode 4, saturated: one frame after the
            # other): action latencies at its chunk rate, text from ask to final text.
            r4 = rows["4"]
            points.append({"batch_size": robots, "rate_hz": round(r4["action_rate"], 4),
                           "mean_ms": round(statistics.fmean(modes["4"].action_ms), 2),
                           "p50_ms": round(r4["action_p50"], 2), "p99_ms": round(r4["action_p99"], 2),
                           "text_mean_ms": round(modes["4"].text_mean_ms(), 2),
                           **decode_cost(before, runners["4"].counters)})
        profile["models"][f"pi05-{shape}-language"] = {"components": ["system1", "system2"], "points": points}
        if args.profile_out:
            import yaml

            Path(args.profile_out).write_text(yaml.safe_dump(profile, sort_keys=False))
            print(f"profile written to {args.profile_out}", flush=True)
        runner = runners["A"]
        for batch in (int(r) for r in args.robots.split(",")):
            if batch > 1:
                together, alone = decode_throughput(runner, batch, args.per_frame * 2)
                print(f"decode only, {batch} generations: {together:.1f} tokens/s batched vs {alone:.1f} one at a "
                      f"time ({together / alone:.2f}x)", flush=True)


LONG_TASK = ("pick up the red cube from the left side of the table and place it gently into the blue bowl, "
             "then push the green block towards the back wall, open the top drawer halfway, take out the "
             "folded towel, unfold it on the table, wipe the spilled water next to the bowl, fold the towel "
             "again, put it back into the drawer and close the drawer slowly without hitting the cube")


class SimRobot:
    """A robot at `fps` as the reference client drives it, in the served-loop study: the harness's
    simulated robot (the client's send trigger, chunk intake and action buffer: one observation in
    flight, sent when the buffered actions last less than the client's automatic `buffer_time_s`, a
    chunk's actions taken from its capture step on, stale ones trimmed), its control ticks run up to
    each moment the loop looks at it."""

    def __init__(self, j: int, t0: float, fps: int, chunk: int, text: bool):
        self.j, self.t0, self.fps, self.chunk, self.text = j, t0, fps, chunk, text
        self.robot = SimulatedRobot(f"robot{j}", dt_s=1.0 / fps)
        self.tick, self.empty, self.ticks = 0, 0, 0
        self.in_flight: int | None = None  # the seq_id of the observation waiting for its chunk
        self.latency_ms: list[float] = []

    def advance_to(self, now: float, record: bool) -> None:
        k = int((now - self.t0) * self.fps)
        while self.tick < k:
            self.tick += 1
            if self.robot.act() is None and record:
                self.empty += 1
            if record:
                self.ticks += 1

    def wants(self, now: float) -> bool:
        """Whether it sends an observation at `now` (its buffer as of then, ticks not yet run included)."""
        due = int((now - self.t0) * self.fps) - self.tick
        return self.robot.would_send(now, max(0, self.robot.buffer.depth - due))

    def send(self, now: float) -> None:
        capture = self.robot.capture(now)
        self.in_flight = None if capture is None else capture.seq

    def answered(self, now: float, record: bool) -> None:
        result = self.robot.take_actions(self.in_flight, np.zeros((self.chunk, 1), dtype=np.float32), now)
        self.in_flight = None
        if record and result.rtt_s is not None:
            self.latency_ms.append(result.rtt_s * 1000)


def served_loop(runner, *, text_robots: int, text: bool, seconds: float, warm_s: float, max_batch: int,
                tokens: int, actions_first: bool, fps: int = 30, chunk: int = 50) -> dict:
    """The server's inference loop over `runner` in real time (the order of server/shell/inference_loop.py
    and server/engine/serving.py: pick up to `max_batch` waiting observations, oldest first, one call, the
    chunks out; then one frame of text, after the batch only when no observation waits if
    `actions_first`, else after every batch (the serving path before text was budgeted); text alone
    when nothing waits), with `text_robots` robots asking actions and text (if `text`) every
    observation and one honest robot asking actions only. Returns the honest robot's empty ticks, the
    action latency percentiles of every robot, and the text tokens/s."""
    from lerobot_zenoh.server.runners.base import InferenceRequest
    from lerobot_zenoh.server.runners.pi05_language import LANGUAGE_EXTRA, LanguageQuery

    n = text_robots + 1
    for j in range(n):
        runner.forget(f"robot{j}")
    t0 = time.perf_counter()
    robots = [SimRobot(j, t0, fps, chunk, text=text and j > 0) for j in range(n)]  # robot0: the honest one
    obs = observations(n, 0)
    waiting: list[int] = []  # robots whose observation waits, in arrival order
    if actions_first:  # what server/engine/serving.py hands the runner: text yields between steps
        runner.yield_to_actions(lambda: bool(waiting) or any(r.in_flight is None and r.wants(time.perf_counter())
                                                             for r in robots))
    else:
        runner.yield_to_actions(None)
    t_tok, tokens_rec0 = None, 0
    shrunk0 = runner.counters["budget_shrunk"]
    seq = 0
    t_rec = t0 + warm_s
    while True:
        now = time.perf_counter()
        if now >= t_rec + seconds:
            break
        record = now >= t_rec
        if record and t_tok is None:
            t_tok, tokens_rec0 = now, runner.counters["tokens"]
        for r in robots:
            r.advance_to(now, record)
            if r.in_flight is None and r.wants(now):
                r.send(now)
                if r.in_flight is not None:
                    waiting.append(r.j)
        if waiting:
            picked, waiting = waiting[:max_batch], waiting[max_batch:]
            reqs = []
            for j in picked:
                seq += 1
                state, images, _ = obs[j]
                task = LONG_TASK if robots[j].text else TASKS[0]
                extras = ({LANGUAGE_EXTRA: LanguageQuery(max_new_tokens=tokens, tag=seq)} if robots[j].text else {})
                reqs.append(InferenceRequest(f"robot{j}", state, images, task, seed=seq, extras=extras))
            runner.run(reqs)
            done = time.perf_counter()
            for j in picked:
                robots[j].advance_to(done, record)
                robots[j].answered(done, record)
            if runner.language_active and (not actions_first or not any(
                    r.in_flight is None and r.wants(time.perf_counter()) for r in robots) and not waiting):
                runner.advance()
        elif runner.language_active:
            runner.advance()
        else:
            time.sleep(0.001)
    elapsed = time.perf_counter() - t_tok if t_tok is not None else float("nan")
    honest = robots[0]
    every = [ms for r in robots for ms in r.latency_ms]
    return {"honest_empty": honest.empty, "honest_ticks": honest.ticks, "honest_p99": pct(honest.latency_ms, 99),
            "p50": pct(every, 50), "p99": pct(every, 99),
            "tokens_s": (runner.counters["tokens"] - tokens_rec0) / elapsed,
            "shrunk": runner.counters["budget_shrunk"] - shrunk0}


def served_table(args) -> None:
    """The honest robot beside 16 robots asking text, and the same fleet without text, side by side."""
    from lerobot_zenoh.server.runners.pi05_language import LanguageSettings

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_language_"))
    shape = args.shapes.split(",")[0]
    runner = load(build(root, shape), args.device, args.dtype)
    runner.run([request(0, 0, observations(1, 0)[0])])  # warm-up
    slo = args.served_slo_ms
    every = {"no-text": ("no text", False, None, True), "text": ("text", True, None, True),
             "text-slo": (f"text, action_slo_ms {slo:.0f}", True, slo, True),
             "old": ("text after every batch", True, None, False),
             "old-slo": (f"text after every batch, slo {slo:.0f}", True, slo, False)}
    conditions = [every[c] for c in args.served_conditions.split(",")]
    print(f"\n## pi05 {shape} served loop ({args.device}): {args.served_robots} robots asking text "
          f"({args.tokens} tokens, tasks of ~190 tokens) + 1 honest robot, {args.served_fps} Hz, chunks of 50, max batch "
          f"{args.served_batch}, {args.served_seconds:.0f} s each after {args.served_warm:.0f} s", flush=True)
    print(f"{'condition':32} {'honest empty':>12} {'honest p99':>10} {'all p50':>8} {'all p99':>8} "
          f"{'tokens/s':>8} {'shrunk':>6}", flush=True)
    for _round in range(args.served_rounds):
        for name, text, slo_ms, actions_first in conditions:
            runner.configure_language(LanguageSettings(max_new_tokens=args.tokens, tokens_per_frame=args.per_frame,
                                                       max_requests=64, action_slo_ms=slo_ms))
            r = served_loop(runner, text_robots=args.served_robots, text=text, seconds=args.served_seconds,
                            warm_s=args.served_warm, max_batch=args.served_batch, tokens=args.tokens,
                            actions_first=actions_first, fps=args.served_fps)
            print(f"{name:32} {r['honest_empty']:5d} of {r['honest_ticks']:4d} {r['honest_p99']:10.0f} "
                  f"{r['p50']:8.0f} {r['p99']:8.0f} {r['tokens_s']:8.1f} {r['shrunk']:6d}", flush=True)


def vlm_table(args) -> None:
    from lerobot_zenoh.checkpoint_builder.build import build_tiny_vlm
    from lerobot_zenoh.server.runners.base import InferenceRequest
    from lerobot_zenoh.server.runners.vlm import VlmRunner, VlmSettings

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_language_"))
    folder = root / "smolvlm"
    if not (folder / "config.json").is_file():
        build_tiny_vlm(folder, force=True)
    cams = {"front": (96, 128), "wrist": (96, 128)}
    runner = VlmRunner.from_pretrained(folder, VlmSettings(output="text", prompt="next subtask?",
                                                           max_new_tokens=args.vlm_tokens, cameras=cams),
                                       device=args.device, dtype=args.dtype)
    rng = np.random.default_rng(0)
    print(f"\n## VLM runner (tiny SmolVLM, {args.device}, {args.dtype}): {args.vlm_tokens} new tokens per robot, "
          "2 cameras 96x128", flush=True)
    print(f"{'robots':>6} {'batched ms':>10} {'one at a time ms':>16} {'tokens/s batched':>16} "
          f"{'one at a time':>13} {'speed-up':>8} {'same text':>9}", flush=True)
    for b in (int(x) for x in args.vlm_robots.split(",")):
        reqs = [InferenceRequest(f"robot{j}", np.zeros(6, np.float32),
                                 {c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c, (h, w) in cams.items()},
                                 "", seed=j) for j in range(b)]
        runner.run(reqs[:1])
        batched_ms, single_ms = [], []
        for _ in range(args.vlm_reps):
            t0 = time.perf_counter()
            together = runner.run(reqs)
            batched_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            alone = [runner.run_one_at_a_time([r])[0] for r in reqs]
            single_ms.append((time.perf_counter() - t0) * 1000)
        same = all(a.text == b_.text for a, b_ in zip(together, alone, strict=True))
        tok = b * args.vlm_tokens
        bm, sm = statistics.median(batched_ms), statistics.median(single_ms)
        print(f"{b:6d} {bm:10.1f} {sm:16.1f} {tok / bm * 1000:16.1f} {tok / sm * 1000:13.1f} {sm / bm:7.2f}x "
              f"{same!s:>9}", flush=True)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--robots", default="1,4,8")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=20, help="N: tokens per text")
    parser.add_argument("--per-frame", type=int, default=5, help="k: decode steps per frame in mode 4")
    parser.add_argument("--slo-factor", type=float, default=1.5,
                        help="mode 4s: action SLO = this x actions-alone p50")
    parser.add_argument("--vlm-robots", default="1,2,4,8,16", help="empty: skip the VLM table")
    parser.add_argument("--vlm-tokens", type=int, default=16)
    parser.add_argument("--vlm-reps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--profile-out", default=None,
                        help="write the combined runner's serving profile (pipelines/profiles.py format) here")
    parser.add_argument("--hardware", default="cpu", help="the profile's hardware name")
    parser.add_argument("--served", action="store_true",
                        help="only the served-loop table: an honest robot beside robots asking text, vs no text")
    parser.add_argument("--served-robots", type=int, default=16)
    parser.add_argument("--served-batch", type=int, default=8)
    parser.add_argument("--served-seconds", type=float, default=8.0)
    parser.add_argument("--served-warm", type=float, default=2.0)
    parser.add_argument("--served-rounds", type=int, default=1)
    parser.add_argument("--served-slo-ms", type=float, default=200.0)
    parser.add_argument("--served-fps", type=int, default=30, help="the robots' control rate")
    parser.add_argument("--served-conditions", default="no-text,text,text-slo",
                        help="of no-text, text, text-slo, old, old-slo (old: text after every batch, whether "
                             "observations wait or not, as the serving path did before text was budgeted)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.served:
        served_table(args)
        return
    if args.shapes:
        pi05_table(args)
    if args.vlm_robots:
        vlm_table(args)


if __name__ == "__main__":
    main()
