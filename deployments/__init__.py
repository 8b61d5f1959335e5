"""Ray Serve deployments: the router (ingress), encoder replicas, and the app builder.

Kept import-light: Serve's controller imports `deployments.autoscaling` on its own.
"""

import time

IMPORTED_AT = time.time()
"""When this process first imported the package: a replica's constructor start minus this is the
time its deployment's imports took (torch, transformers, model code)."""
