"""Prometheus metrics through `ray.serve.metrics` (exported with Serve's own, Serve tags added).

Ray prefixes custom metrics with `ray_`; e.g. `vlm_encoder_vision_tokens` is scraped as
`ray_vlm_encoder_vision_tokens_total`. configs/prometheus.yml shows a scrape config.
Metric objects are created inside each replica (in its constructor).

Gauges must be set again and again: Ray exports a gauge's series only while it is being set.
One set once and left alone vanished from the scrape ~20 s later (Ray 2.60, measured with a
1 s report interval), so a queue gauge set only when work arrives had gaps whenever a replica
sat idle, and a dashboard or alert read "no data" for "0 queued". `refresh_gauges` re-sets them
on a timer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ray.serve.metrics import Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

GAUGE_REFRESH_S = 5.0
"""How often a replica re-sets its gauges (well inside the ~20 s after which Ray drops a series)."""

SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
FILL = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


class RouterMetrics:
    def __init__(self):
        self.vision_tokens = Counter("vlm_router_vision_tokens", description="Vision tokens returned to callers.")
        self.queued_tokens = Gauge("vlm_router_queued_tokens", description="Tokens queued in the router or in flight.")
        self.pack_fill = Histogram(
            "vlm_router_pack_fill", description="Real tokens / token budget of each pack sent.", boundaries=FILL
        )
        self.pack_requests = Histogram(
            "vlm_router_pack_requests", description="Distinct requests per pack.", boundaries=[1, 2, 4, 8, 16, 32, 64]
        )
        self.preprocess_seconds = Histogram(
            "vlm_router_preprocess_seconds",
            description="Header checks, decoding and resizing per request.",
            boundaries=SECONDS,
        )
        self.transfer_seconds = Histogram(
            "vlm_router_transfer_seconds",
            description="Pack round trip minus the replica's queueing and forward time (moving pixels and results).",
            boundaries=SECONDS,
        )
        self.rejected = Counter(
            "vlm_router_rejected_requests", description="Requests refused, by reason.", tag_keys=("reason",)
        )
        self.cache_hits = Counter("vlm_router_cache_hits", description="Items answered from the embedding cache.")
        self.cache_misses = Counter("vlm_router_cache_misses", description="Cacheable items not in the cache.")
        self.cache_dedup = Counter(
            "vlm_router_cache_inflight_dedup", description="Items that joined an identical item already in flight."
        )
        self.cache_bytes = Gauge("vlm_router_cache_bytes", description="Bytes held by the embedding cache.")


class EncoderMetrics:
    def __init__(self):
        self.vision_tokens = Counter("vlm_encoder_vision_tokens", description="Vision tokens encoded.")
        self.queued_tokens = Gauge("vlm_encoder_queued_tokens", description="Tokens waiting in this replica.")
        self.forward_seconds = Histogram(
            "vlm_encoder_forward_seconds", description="Normalize, patchify and encode one pack.", boundaries=SECONDS
        )
        self.queue_seconds = Histogram(
            "vlm_encoder_queue_seconds", description="A pack's wait in the replica before it runs.", boundaries=SECONDS
        )
        self.graph_hits = Counter(
            "vlm_encoder_graph_hits",
            description='Packs run by a graph, per token budget ("recurring": a recurring pack\'s own graph).',
            tag_keys=("budget",),
        )
        self.graph_misses = Counter(
            "vlm_encoder_graph_misses", description="Packs that fit a budget but ran eagerly.", tag_keys=("budget",)
        )
        self.eager_fallbacks = Counter(
            "vlm_encoder_eager_fallbacks",
            description="Runs without a graph, by reason; compiled: true (compiled forward on the exact layout), "
            "false (uncompiled), fallback (would have compiled on the request; ran uncompiled).",
            tag_keys=("reason", "compiled"),
        )
        self.padded_tokens = Counter("vlm_encoder_padded_tokens", description="Padding tokens computed by graphs.")
        self.graphs_live = Gauge(
            "vlm_encoder_graphs_live", description="Graphs serving packs (the warm-up's progress)."
        )
        self.full_speed = Gauge(
            "vlm_encoder_full_speed",
            description="1 once the warm-up has finished (every graph and route live), else 0.",
        )
        self.computed_tokens = Counter(
            "vlm_encoder_computed_tokens",
            description="Tokens computed by graphs (real + padding); waste = padded/computed.",
        )


def refresh_gauges(update: Callable[[], None], interval_s: float = GAUGE_REFRESH_S) -> threading.Event:
    """Call `update` (which sets a replica's gauges from its current state) now and every
    `interval_s` seconds on a daemon thread, until the returned event is set. An error in
    `update` is logged and the next tick tries again: metrics never stop a replica."""
    stop = threading.Event()

    def loop() -> None:
        while True:
            try:
                update()
            except Exception:
                logger.exception("refreshing gauges failed")
            if stop.wait(interval_s):
                return

    threading.Thread(target=loop, name="refresh-gauges", daemon=True).start()
    return stop
