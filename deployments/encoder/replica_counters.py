"""What an encoder replica did and holds: forwards, packs, tokens and seconds per step (cumulative,
for rates between two reports), queued and in-flight tokens (for the routers and the autoscaler),
and each router's tokens it has not placed yet (for the autoscaler).

The drain task, the forward thread and the store threads all write here: every change to more
than one number happens under one lock.
"""

from __future__ import annotations

import os
import threading
import time

from ..autoscaling import ROUTER_REPORT_S, router_waiting_metrics

STEPS = ("preprocess", "run", "store", "between")
"""The steps of a forward whose wall seconds are summed: normalize and patchify, the runner, storing
results, and from a forward's end to the next one's start while packs waited (the trip back
through the event loop, and any wait for the device lock a warm-up step holds)."""


class ReplicaCounters:
    """One replica's counters (`work_summary`, `autoscaling_stats`, `describe`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.forwards = 0
        self.merged_packs = 0
        self.merged_requests = 0
        self.tokens = 0
        """Vision tokens of the packs run (failed ones too)."""
        self.seconds = dict.fromkeys(STEPS, 0.0)
        """Cumulative wall seconds of each step of a forward (the device is busy at most in "run")."""
        self.queued_tokens = 0
        self.inflight_tokens = 0
        self._routers_waiting: dict[str, tuple[int, int, float]] = {}
        """Per router, the tokens it had not placed as its last pack here said, that figure's
        sequence number at the router, and when the pack arrived (our monotonic clock)."""

    # ---- writes ----

    def count(self, queued: int = 0, inflight: int = 0) -> None:
        with self._lock:
            self.queued_tokens += queued
            self.inflight_tokens += inflight

    def add_seconds(self, step: str, seconds: float) -> None:
        with self._lock:
            self.seconds[step] += seconds

    def ran(self, packs: int, requests: int, tokens: int) -> None:
        """One forward of `packs` merged packs holding `requests` requests' items and `tokens` tokens."""
        with self._lock:
            self.forwards += 1
            self.merged_packs += packs
            self.merged_requests += requests
            self.tokens += tokens

    def router_said(self, router: str, waiting_tokens: int, report: int) -> None:
        """What a router's pack said about the tokens it has not placed on a replica yet."""
        self._routers_waiting[router] = (waiting_tokens, report, time.monotonic())

    # ---- reads ----

    @property
    def load_tokens(self) -> int:
        """Queued and in-flight tokens: what the request router balances on."""
        return self.queued_tokens + self.inflight_tokens

    def work_summary(self, runner_stats) -> dict:
        """Cumulative counters, stamped with this host's clock: the difference of two reports is
        one replica's forwards, tokens and busy seconds over the time between them.
        `runner_stats`: the runner's `RunnerStats`."""
        with self._lock:
            seconds = {step: round(value, 6) for step, value in self.seconds.items()}
            counts = (self.forwards, self.merged_packs, self.merged_requests, self.tokens)
        # within "run": what a new replica's forwards spend on top of serving until they have seen
        # their traffic (each graph's checked first pack, recurring packs' graphs captured)
        seconds["first_pack_checks"] = round(runner_stats.first_pack_check_s, 6)
        seconds["recurring_captures"] = round(runner_stats.recurring_capture_s, 6)
        forwards, packs, requests, tokens = counts
        return {
            "pid": os.getpid(),
            "at": round(time.time(), 3),
            "forwards": forwards,
            "merged_packs": packs,
            "merged_requests": requests,
            "tokens": tokens,
            "step_seconds": seconds,
        }

    def per_forward(self) -> dict:
        """Packs and requests per forward: what packing across callers achieves (requests: an upper
        bound where one request's items went in two packs of one forward)."""
        forwards = self.forwards
        return {
            "packs_per_forward": round(self.merged_packs / forwards, 3) if forwards else 0.0,
            "requests_per_forward": round(self.merged_requests / forwards, 3) if forwards else 0.0,
        }

    def autoscaling_stats(self) -> dict:
        """This replica's tokens, and each router's held-back tokens as the router's last pack
        here said (`router_waiting_metrics`; the policy counts each router once). A router silent
        for `ROUTER_REPORT_S` is forgotten."""
        now = time.monotonic()
        for router, (_, _, arrived) in list(self._routers_waiting.items()):
            if now - arrived > ROUTER_REPORT_S:
                del self._routers_waiting[router]
        return {
            "queued_tokens": float(self.queued_tokens),
            "inflight_tokens": float(self.inflight_tokens),
            **router_waiting_metrics({r: (tokens, seq) for r, (tokens, seq, _) in self._routers_waiting.items()}),
        }
