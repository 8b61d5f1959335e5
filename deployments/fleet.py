"""What the router knows about the encoder replicas: how many run, and whether any can serve.

Read from Serve's own status (the controller), refreshed in the background, so `/health` and
admission answer at once from the last reading instead of waiting on the controller, and a
request that no replica can serve gets 503 instead of queueing behind a replica that will
never start.
"""

from __future__ import annotations

import logging
import threading
import time

from ray import serve

logger = logging.getLogger("ray.serve")

REFRESH_S = 0.5
"""Between readings while no replica runs or the deployment is not healthy."""
STEADY_REFRESH_S = 5.0
"""Between readings while the deployment is healthy: `serve.status()` costs the router ~16 ms
of CPU (it pickles every deployment's request router class), and a replica that dies between
readings fails its packs, which are resent or answered 503 anyway."""
STALE_S = 10.0
"""A reading older than this (the controller stopped answering) counts as unknown."""


class EncoderFleet:
    def __init__(self, app: str, deployment: str = "EncoderReplica", routers: str = "EncoderRouter"):
        self.app = app
        self.deployment = deployment
        self.router_deployment = routers
        self.states: dict[str, int] = {}
        """Replica counts by Serve state (RUNNING, STARTING, ...)."""
        self.routers = 1
        """Running router replicas of the application (they share the encoder replicas' slots)."""
        self.status = "UNKNOWN"
        self.message = ""
        self._read_at = 0.0
        self._announced = False
        self._first = threading.Event()
        self._stop = threading.Event()

    @property
    def running(self) -> int:
        return self.states.get("RUNNING", 0)

    @property
    def fresh(self) -> bool:
        return time.monotonic() - self._read_at < STALE_S

    @property
    def ready(self) -> bool:
        """At least one encoder replica can take packs (per a recent reading)."""
        return self.fresh and self.running > 0

    def why_not_ready(self) -> str:
        if not self.fresh:
            return "the encoder replicas' state is unknown (Serve's controller did not answer)"
        detail = f": {self.message}" if self.message else ""
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self.states.items())) or "none"
        return f"no encoder replica is ready ({counts}; deployment {self.status}){detail}"

    def start(self, first_reading_s: float = STALE_S) -> None:
        """Refresh in a background thread; wait (at most `first_reading_s`) for the first reading."""
        threading.Thread(target=self._refresh_forever, name="encoder-fleet", daemon=True).start()
        self._first.wait(first_reading_s)

    def stop(self) -> None:
        self._stop.set()

    def _refresh_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self._read()
                self._first.set()
            except Exception:  # keep the last reading; it goes stale and says so
                logger.debug("reading Serve's status failed", exc_info=True)
            if self.ready and not self._announced:
                self._announced = True
                logger.info(
                    "service ready: %d encoder replica(s) take requests (application %r)", self.running, self.app
                )
            steady = self.ready and self.status == "HEALTHY"
            self._stop.wait(STEADY_REFRESH_S if steady else REFRESH_S)

    def _read(self) -> None:
        app = serve.status().applications.get(self.app)
        deployment = None if app is None else app.deployments.get(self.deployment)
        if deployment is not None:
            self.states = _by_state(deployment.replica_states)
            self.status = str(deployment.status).rsplit(".", 1)[-1]
            self.message = deployment.message or ""
        routers = None if app is None else app.deployments.get(self.router_deployment)
        if routers is not None:
            self.routers = max(1, _by_state(routers.replica_states).get("RUNNING", 0))
        self._read_at = time.monotonic()


def _by_state(replica_states: dict) -> dict[str, int]:
    """Replica counts by state name (Serve's keys: the state's value, or the enum itself)."""
    return {str(k).rsplit(".", 1)[-1]: v for k, v in replica_states.items()}
