"""The router process: the `EncoderRouter` ingress (HTTP and handles), intake, packing queue and embedding cache."""
