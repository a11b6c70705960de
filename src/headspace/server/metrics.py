"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own.

Requests running / waiting / finished / aborted, prompt and generated tokens, time to first
token and time per output token, and what the head map holds: (layer, kv head) entries per
tier, KV pages in use on the GPU and in host memory, swaps; per lane, its requests by state,
steps and prompt tokens computed.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from headspace.engine.outputs import EngineLoad, RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    """Counters, gauges and histograms the engine loop updates after each step."""

    def __init__(self, model_name: str):
        disable_created_metrics()  # no ``*_created`` series beside every counter
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}
        p = "headspace_"

        def gauge(name, doc, extra=()):
            return Gauge(p + name, doc, [*labels, *extra], registry=registry)

        def counter(name, doc, extra=()):
            return Counter(p + name, doc, [*labels, *extra], registry=registry)

        self._running = gauge("requests_running", "requests in the engine's batch")
        self._waiting = gauge("requests_waiting", "requests queued, not yet in the batch")
        self._swapped = gauge("requests_swapped", "requests swapped out to host pages")
        self._finished = counter("requests_finished", "requests that ended", ["reason"])
        self._prompt = counter("prompt_tokens", "prompt tokens of admitted requests")
        self._generated = counter("generation_tokens", "tokens generated")
        self._ttft = Histogram(p + "time_to_first_token_seconds", "arrival to first token",
                               list(labels), buckets=TTFT_BUCKETS, registry=registry)  # fmt: skip
        self._tpot = Histogram(p + "time_per_output_token_seconds",
                               "time between a request's tokens after its first",
                               list(labels), buckets=TPOT_BUCKETS, registry=registry)  # fmt: skip
        self._entries = gauge("head_entries", "(layer, kv head) entries of the head map "
                              "by tier", ["tier"])  # fmt: skip
        self._pages = gauge("kv_pages_in_use", "KV pages held by requests", ["tier"])
        self._swaps = counter("swaps", "requests swapped out to host pages")
        self._swaps_seen = 0
        self._errors = counter("request_errors", "requests answered with an error, by HTTP "
                               "status", ["status"])  # fmt: skip
        self._lane_requests = gauge("lane_requests", "requests by lane (resident, offload, "
                                    "main; queued: waiting for the offload lane's part of the "
                                    "arena) and state", ["lane", "state"])  # fmt: skip
        self._lane_steps = counter("lane_steps", "steps that ran compute, by lane", ["lane"])
        self._lane_prefilled = counter("lane_prefill_tokens", "prompt tokens computed, by "
                                       "lane", ["lane"])  # fmt: skip
        self._lane_seen: dict[str, tuple[int, float]] = {}  # lane -> (steps, tokens) counted
        self._reserved = gauge("gpu_peak_reserved_bytes", "GPU memory the engine's allocator "
                               "reserved at most (0 on the CPU)")  # fmt: skip
        self._compile = counter(
            "compile_seconds",
            "seconds the process spent compiling "
            "kernels (torch.compile and Triton), the warm-up's included",
        )
        self._compile_seen = 0.0
        self._labels = labels
        self.prompt_tokens = self._prompt.labels(**labels)
        self.aborted = self._finished.labels(**labels, reason="abort")

    def error(self, status: int) -> None:
        self._errors.labels(**self._labels, status=str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(**self._labels, reason=reason).inc()

    def observe_tokens(self, request, output: RequestOutput, now: float) -> None:
        """``output``'s new tokens: the first one's delay from arrival, the others' gaps."""
        count = len(output.new_token_ids)
        if count == 0:
            return
        self._generated.labels(**self._labels).inc(count)
        first = len(output.token_ids) == count  # this step carried the first token
        if first:
            self._ttft.labels(**self._labels).observe(now - request.arrived)
        elif request.last_token_at:
            gap = (now - request.last_token_at) / count
            for _ in range(count):
                self._tpot.labels(**self._labels).observe(gap)
        request.last_token_at = now

    def observe_load(self, load: EngineLoad, queued: int) -> None:
        labels = self._labels
        self._running.labels(**labels).set(load.running + load.swapped)
        self._waiting.labels(**labels).set(load.waiting + queued)
        self._swapped.labels(**labels).set(load.swapped)
        for tier, count in (("resident", load.resident_entries),
                            ("streamed", load.streamed_entries),
                            ("hybrid", load.hybrid_entries)):  # fmt: skip
            self._entries.labels(**labels, tier=tier).set(count)
        self._pages.labels(**labels, tier="gpu").set(load.gpu_pages_used)
        self._pages.labels(**labels, tier="host").set(load.host_pages_used)
        self._swaps.labels(**labels).inc(load.num_swaps - self._swaps_seen)
        self._swaps_seen = load.num_swaps
        self._reserved.labels(**labels).set(load.peak_reserved_bytes)
        self._compile.labels(**labels).inc(max(load.compile_seconds - self._compile_seen, 0.0))
        self._compile_seen = max(load.compile_seconds, self._compile_seen)
        self._observe_lanes(load)

    def _observe_lanes(self, load: EngineLoad) -> None:
        """Requests per lane and state; each lane's steps and prompt tokens since the last
        look (a lane's totals only grow)."""
        labels, counts = self._labels, {}
        for view in load.requests:
            counts[view.lane, view.state] = counts.get((view.lane, view.state), 0) + 1
        lanes = [lane.name for lane in load.lanes] + ["queued"]
        for lane in lanes:
            for state in ("waiting", "prefilling", "decoding", "swapped"):
                self._lane_requests.labels(**labels, lane=lane, state=state).set(
                    counts.get((lane, state), 0))  # fmt: skip
        for lane in load.lanes:
            steps, tokens = self._lane_seen.get(lane.name, (0, 0.0))
            self._lane_steps.labels(**labels, lane=lane.name).inc(max(lane.steps - steps, 0))
            self._lane_prefilled.labels(**labels, lane=lane.name).inc(
                max(lane.prefilled_tokens - tokens, 0.0))  # fmt: skip
            self._lane_seen[lane.name] = (lane.steps, lane.prefilled_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)
