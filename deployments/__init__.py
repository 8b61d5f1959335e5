"""Ray Serve deployments: the router (ingress), encoder replicas, and the app builder.

Kept import-light: Serve's controller imports `deployments.autoscaling` on its own.
"""
