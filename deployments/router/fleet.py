"""What the router knows about the encoder replicas (how many run, whether any can serve) and,
in an E/PD application, about the LLM deployment (whether a replica runs, or why not).

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


MESSAGE_CHARS = 400
"""The most of a deployment's status message a reason quotes (Serve's may hold a whole traceback)."""


def short_message(message: str) -> str:
    """Serve's status message of a deployment, in one line: a constructor's traceback becomes its
    last line (the exception), after the sentence that introduces it."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    if any(line.startswith("Traceback") for line in lines):
        lead = lines[0] if not lines[0].startswith("Traceback") else ""
        shown = f"{lead} ... {lines[-1]}" if lead else lines[-1]
    else:
        shown = " ".join(lines)
    return shown if len(shown) <= MESSAGE_CHARS else shown[: MESSAGE_CHARS - 3] + "..."


class DeploymentReading:
    """One deployment's replica counts, status and message, as Serve's last status gave them."""

    def __init__(self, name: str):
        self.name = name
        self.states: dict[str, int] = {}
        self.status = "UNKNOWN"
        self.message = ""

    @property
    def running(self) -> int:
        return self.states.get("RUNNING", 0)

    def read(self, deployment) -> None:
        self.states = _by_state(deployment.replica_states)
        self.status = str(deployment.status).rsplit(".", 1)[-1]
        self.message = deployment.message or ""

    def why_not_running(self) -> str:
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self.states.items())) or "no replica"
        detail = f": {short_message(self.message)}" if self.message.strip() else ""
        return f"{counts}; deployment {self.status}{detail}"


class EncoderFleet:
    def __init__(
        self, app: str, deployment: str = "EncoderReplica", routers: str = "EncoderRouter", llm: str | None = None
    ):
        self.app = app
        self.deployment = deployment
        self.router_deployment = routers
        self.states: dict[str, int] = {}
        """Replica counts by Serve state (RUNNING, STARTING, ...)."""
        self.routers = 1
        """Running router replicas of the application (they share the encoder replicas' slots)."""
        self.status = "UNKNOWN"
        self.message = ""
        self.llm = None if llm is None else DeploymentReading(llm)
        """The E/PD application's LLM deployment (None: encoder only)."""
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

    @property
    def llm_ready(self) -> bool:
        """No LLM, or at least one of its replicas runs (per a recent reading)."""
        return self.llm is None or (self.fresh and self.llm.running > 0)

    def why_llm_not_ready(self) -> str:
        """Why chat requests cannot reach the LLM now, naming its deployment."""
        if not self.fresh:
            return f"the LLM deployment {self.llm.name!r}'s state is {self._unknown()}"
        return f"LLM deployment {self.llm.name!r} is not running: {self.llm.why_not_running()}"

    def why_not_ready(self) -> str:
        if not self.fresh:
            return f"the encoder replicas' state is {self._unknown()}"
        detail = f": {self.message}" if self.message else ""
        counts = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self.states.items())) or "none"
        return f"no encoder replica is ready ({counts}; deployment {self.status}){detail}"

    def _unknown(self) -> str:
        if not self._first.is_set():
            return "not read yet (the router has just started)"
        return "unknown (Serve's controller did not answer)"

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
            if self.ready and self.llm_ready and not self._announced:
                self._announced = True
                llm = "" if self.llm is None else f", {self.llm.running} LLM replica(s) of {self.llm.name!r}"
                logger.info(
                    "service ready: %d encoder replica(s) take requests%s (application %r)",
                    self.running,
                    llm,
                    self.app,
                )
            llm_steady = self.llm is None or (self.llm_ready and self.llm.status == "HEALTHY")
            steady = self.ready and self.status == "HEALTHY" and llm_steady
            self._stop.wait(STEADY_REFRESH_S if steady else REFRESH_S)

    def _read(self) -> None:
        app = serve.status().applications.get(self.app)
        deployment = None if app is None else app.deployments.get(self.deployment)
        if deployment is not None:
            self.states = _by_state(deployment.replica_states)
            self.status = str(deployment.status).rsplit(".", 1)[-1]
            self.message = deployment.message or ""
        llm = None if app is None or self.llm is None else app.deployments.get(self.llm.name)
        if llm is not None:
            self.llm.read(llm)
        routers = None if app is None else app.deployments.get(self.router_deployment)
        if routers is not None:
            self.routers = max(1, _by_state(routers.replica_states).get("RUNNING", 0))
        self._read_at = time.monotonic()


def _by_state(replica_states: dict) -> dict[str, int]:
    """Replica counts by state name (Serve's keys: the state's value, or the enum itself)."""
    return {str(k).rsplit(".", 1)[-1]: v for k, v in replica_states.items()}
