"""Where the GPU's time goes while a long prompt is prefilled beside short streams: the
resident lane's decode steps and the offload lane's prefill pieces, each on its own CUDA
stream, measured from a kernel trace of a window during the long prefill.

    PYTHONPATH=src python bench/profiles/profile_mixed.py [--window 2.0] [--after 6.0]
        [--phase prefill|decode] [--alone]

Four short requests (1,536-token prompts) decode; a 128K prompt arrives; ``--after``
seconds later a ``--window`` of kernels is traced (torch.profiler). Per stream it prints
the time busy (the union of its kernels' intervals), the time both streams run at once, the
kernels that take most, and the short requests' time per token inside and outside the
window; then how far the long prefill went, against its rate alone (``--alone``: the same
prompt with no short ones, same GPU budget). With ``--phase decode`` the window opens
``--after`` seconds past the long request's first token instead, and the long request's own
time per token in the window is printed beside the short ones'. Writes
``profile_mixed_<phase>_<gpu>_<date>.json`` (to $OUT when set) and the trace beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA31_8B, environment, gpu_tag, make_engine, random_model, write_result  # noqa: E402
from headspace.engine.hooks import EngineHooks  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402

K = 1024
SHORTS, SHORT_PROMPT, LONG_PROMPT = 4, 1536, 128 * K - 256
SHORT_NEW = 4000  # (their KV fits the resident lane: they outlast the window)
OPTIONS = {"gpu_memory": "24GiB", "host_memory": "100GiB", "max_context": 512 * K}


def _ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 100_000, (n,), generator=generator).tolist()


class StackSampler:
    """Where each named thread is, every ``every_s`` seconds while running: its innermost
    frames (up to 4, the first of them in headspace or torch), counted."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.counts = every_s, defaultdict(lambda: defaultdict(int))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        names = {}
        while not self._stop.wait(self.every_s):
            names.update({t.ident: t.name for t in threading.enumerate()})
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                where = []
                while frame is not None and len(where) < 4:
                    code = frame.f_code
                    where.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                self.counts[names.get(ident, str(ident))][" < ".join(where)] += 1

    def top(self, n: int = 8) -> dict:
        return {name: sorted(c.items(), key=lambda kv: -kv[1])[:n]
                for name, c in self.counts.items()}  # fmt: skip


def run(engine, lane_steps: dict, shorts: int, after_s: float, window_s: float,
        trace_path: Path, phase: str = "prefill") -> dict:  # fmt: skip
    """Shorts decoding, the long prompt added, a traced window (``after_s`` seconds after
    the arrival, or with ``phase="decode"`` after the long request's first token); the long
    one aborted at the end. Returns the short and long tokens' times, the window and the
    long request's progress."""
    params = SamplingParams(max_new_tokens=SHORT_NEW, ignore_eos=True)
    short_ids = [engine.add_request(_ids(SHORT_PROMPT, i), params) for i in range(shorts)]
    token_times: list[float] = []  # when any short request's token came out
    while shorts and len(token_times) < 20 * shorts:  # their prefill done, decoding steadily
        token_times += [time.perf_counter() for o in engine.step() if o.new_token_ids]
    token_times.clear()
    arrived = time.perf_counter()
    long_new = 16 if phase == "prefill" else 100_000  # (decode: aborted after the window)
    long_id = engine.add_request(
        _ids(LONG_PROMPT, 99), SamplingParams(max_new_tokens=long_new, ignore_eos=True)
    )
    window, long_times, sampler = None, [], StackSampler()
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    deadline = arrived + after_s + window_s + 180
    traced = lambda: window is not None and window[1] is not None  # noqa: E731
    while (not long_times or not traced()) and time.perf_counter() < deadline:
        now = time.perf_counter()
        since = arrived if phase == "prefill" else (long_times[0] if long_times else None)
        if window is None and since is not None and now - since >= after_s:
            profiler.start()
            sampler.__enter__()
            window = [now, None]
        elif window is not None and window[1] is None and now - window[0] >= window_s:
            torch.cuda.synchronize()
            profiler.stop()
            sampler.__exit__()
            window[1] = time.perf_counter()
            if not shorts and phase == "prefill":
                break
        for out in engine.step():
            if out.request_id == long_id and out.new_token_ids:
                long_times.append(time.perf_counter())
            elif out.new_token_ids:
                token_times.append(time.perf_counter())
        if not shorts and not engine.has_unfinished():
            break
    views = engine.load().requests
    progress = {v.request_id: v for v in views}.get(long_id)
    lanes = sorted(f"{v.lane}:{v.state}" for v in views)
    inside = [t for t in lane_steps["offload"] if window and window[0] <= t <= (window[1] or 0)]
    for request_id in [long_id, *short_ids]:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    profiler.export_chrome_trace(str(trace_path))
    return {"token_times": token_times, "long_times": long_times, "window": window,
            "arrived": arrived, "first_token_s": long_times[0] - arrived if long_times else None,
            "offload_steps_in_window": len(inside), "lanes": lanes, "stacks": sampler.top(),
            "long_state": None if progress is None else progress.state}  # fmt: skip


def kernel_summary(trace_path: Path) -> dict:
    """Per stream: busy seconds (union of its kernels' and copies' intervals), the kernels
    that take most; seconds both busiest streams are busy at once."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    names: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in kernels:
        stream = e.get("args", {}).get("stream", -1)
        by_stream[stream].append((e["ts"], e["ts"] + e["dur"]))
        names[stream][e["name"][:60]] += e["dur"] / 1e6
    if not kernels:
        return {"streams": {}}
    start = min(a for spans in by_stream.values() for a, _ in spans)
    end = max(b for spans in by_stream.values() for _, b in spans)
    unions = {s: _union(spans) for s, spans in by_stream.items()}
    streams = {}
    for s, spans in unions.items():
        top = sorted(names[s].items(), key=lambda kv: -kv[1])[:6]
        busy = sum(b - a for a, b in spans) / 1e6
        streams[str(s)] = {"busy_s": busy, "kernels": len(by_stream[s]),
                           "top": [[n, round(t, 4)] for n, t in top]}  # fmt: skip
    busiest = sorted(unions, key=lambda s: -streams[str(s)]["busy_s"])[:2]
    both = _overlap(unions[busiest[0]], unions[busiest[1]]) / 1e6 if len(busiest) == 2 else 0.0
    return {"span_s": (end - start) / 1e6, "streams": streams, "both_busy_s": both,
            "busiest": [str(s) for s in busiest]}  # fmt: skip


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def tpot_ms(times: list[float], inside: tuple[float, float] | None) -> dict:
    """p50/p99 of the gaps (ms) between one step's tokens and the next's, of the steps
    inside ``inside`` (start, end; None: all)."""
    steps = sorted(set(round(t, 4) for t in times))
    gaps = [(b - a) * 1e3 for a, b in zip(steps, steps[1:], strict=False)
            if inside is None or inside[0] <= a <= inside[1]]  # fmt: skip
    if len(gaps) < 2:
        return {"p50": None, "p99": None, "steps": len(gaps)}
    cuts = statistics.quantiles(gaps, n=100)
    return {"p50": statistics.median(gaps), "p99": cuts[98], "steps": len(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--after", type=float, default=6.0, help="seconds after the arrival")
    parser.add_argument("--window", type=float, default=2.0, help="seconds traced")
    parser.add_argument("--alone", action="store_true", help="also trace the long one alone")
    parser.add_argument(
        "--phase",
        choices=("prefill", "decode"),
        default="prefill",
        help="trace the long request's prefill or its decode (window from "
        "--after seconds past its first token)",
    )
    args = parser.parse_args()
    sys.setswitchinterval(0.0005)  # as `headspace serve` sets it (its lanes share the GIL)
    env = environment()
    out = Path(os.environ.get("OUT", "."))
    model = random_model(LLAMA31_8B)
    lane_steps: dict[str, list[float]] = defaultdict(list)  # when each lane began a step
    hooks = EngineHooks(lane_step=lambda lane: lane_steps[lane].append(time.perf_counter()))
    engine = make_engine(model, hooks=hooks, **OPTIONS)
    result = {"env": env, "config": LLAMA31_8B, "options": OPTIONS, "phase": args.phase, "runs": {}}
    for name, shorts in [("mixed", SHORTS)] + ([("alone", 0)] if args.alone else []):
        trace = out / f"profile_mixed_{name}_trace.json"
        got = run(engine, lane_steps, shorts, args.after, args.window, trace, args.phase)
        summary = kernel_summary(trace)
        window = tuple(got["window"]) if got["window"] and got["window"][1] else None
        summary["short_tpot_ms_in_window"] = tpot_ms(got["token_times"], window)
        before = (got["arrived"], window[0]) if window else None  # the prefill, untraced
        summary["short_tpot_ms_before_window"] = tpot_ms(got["token_times"], before)
        summary["long_tpot_ms_in_window"] = tpot_ms(got["long_times"], window)
        for key in ("long_state", "first_token_s", "offload_steps_in_window", "lanes", "stacks"):
            summary[key] = got[key]
        result["runs"][name] = summary
        if trace.stat().st_size > 60 * 2**20:  # (too large to bring back)
            trace.unlink()
    write_result(f"profile_mixed_{args.phase}_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\n{'run':<7}{'stream':>8}{'busy s':>8}{'kernels':>9}  top kernels (s)")
    for name, summary in result["runs"].items():
        for stream, row in summary["streams"].items():
            top = ", ".join(f"{n[:28]} {t:.3f}" for n, t in row["top"][:3])
            print(f"{name:<7}{stream:>8}{row['busy_s']:>8.3f}{row['kernels']:>9}  {top}")
        print(f"{name}: span {summary.get('span_s', 0):.3f} s, both busiest streams at once "
              f"{summary.get('both_busy_s', 0):.3f} s; offload lane steps in window "
              f"{summary['offload_steps_in_window']}; short tpot in window "
              f"{summary['short_tpot_ms_in_window']}, before it "
              f"{summary['short_tpot_ms_before_window']}; long tpot in window "
              f"{summary['long_tpot_ms_in_window']}; {summary['lanes']}")  # fmt: skip
        for thread, stacks in summary["stacks"].items():
            for where, count in stacks[:5]:
                print(f"  {thread[:14]:<14}{count:>5}  {where[:160]}")


if __name__ == "__main__":
    main()
