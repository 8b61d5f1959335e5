"""What the router knows about the encoder replicas: how many run, and whether any can serve.

Read from Serve's own status (the controller), refreshed in the background, so `/health` and
admission answer at once from the last reading instead of waiting on the controller, and a
request that no replica can serve gets 503 instead of queueing behind a replica that will
never start.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

logger = logging.getLogger("ray.serve")

REFRESH_S = 1.0
STALE_S = 10.0
"""A reading older than this (the controller stopped answering) counts as unknown."""


class EncoderFleet:
    def __init__(self, app: str, deployment: str = "EncoderReplica"):
        self.app = app
        self.deployment = deployment
        self.states: dict[str, int] = {}
        """Replica counts by Serve state (RUNNING, STARTING, ...)."""
        self.status = "UNKNOWN"
        self.message = ""
        self._read_at = 0.0
        self._task: asyncio.Task | None = None
        self._first: asyncio.Event | None = None

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

    async def start(self) -> None:
        """Start refreshing (once), and wait for the first reading (at most `STALE_S`)."""
        if self._task is None:
            self._first = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._refresh_forever())
        if not self._first.is_set():
            try:
                await asyncio.wait_for(self._first.wait(), STALE_S)
            except asyncio.TimeoutError:
                pass

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(asyncio.to_thread(self._read), STALE_S)
                self._first.set()
            except Exception:  # keep the last reading; it goes stale and says so
                logger.debug("reading Serve's status failed", exc_info=True)
            await asyncio.sleep(REFRESH_S)

    def _read(self) -> None:
        app = serve.status().applications.get(self.app)
        deployment = None if app is None else app.deployments.get(self.deployment)
        if deployment is not None:
            self.states = {str(k).rsplit(".", 1)[-1]: v for k, v in deployment.replica_states.items()}
            self.status = str(deployment.status).rsplit(".", 1)[-1]
            self.message = deployment.message or ""
        self._read_at = time.monotonic()
