"""Ray Serve deployments: the router (ingress), encoder replicas, and the app builder.

Kept import-light: Serve's controller imports `deployments.autoscaling` on its own.
"""

import time

IMPORTING_SINCE = time.monotonic()
"""When this process first imported the package: in a Serve replica, the start of its deployment
module's imports (Serve imports the class by path), unless something imported the package earlier."""
