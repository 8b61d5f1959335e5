"""Ray Serve deployments, one subpackage per process: `router/` (the ingress), `decode/` (its decode
workers), `encoder/` (the encoder replicas), `llm/` (the LLM replicas). The modules here are shared
and light: the app builder, config and its validation, wire types, errors, metrics, the autoscaling policy.

Kept import-light: Serve's controller imports `deployments.autoscaling` on its own.
"""

import time

IMPORTING_SINCE = time.monotonic()
"""When this process first imported the package: in a Serve replica, the start of its deployment
module's imports (Serve imports the class by path), unless something imported the package earlier."""
