"""Pre-build the compile cache of a deployment, so its replicas load compiled code instead of compiling.

    python -m deployments compile-cache --config configs/gpu.yaml [--app encoder] [--dir /shared/cache]
        [--key-file /etc/vlm-encoder-serve/cache.key]

Reads the Serve config's application args (validated as `AppConfig`), loads the encoder on
this machine's GPU exactly as a replica does, and runs its full warm-up (compile, graphs,
compiled exact route) in the foreground; the warm-up saves the compiled artifacts under
`graphs.compile_cache` (or `--dir`) in a subdirectory keyed by model, layouts, torch, Triton and
GPU (`encoder_graphs/compile_cache.py`). Run it on the GPU type that will serve, with
`graphs.compile: true`; replicas started afterwards with the same config and directory find the
artifacts, and the warm-up record beside them (`encoder_graphs/warmup_record.py`: each graph's
check and time), so they capture without checking each graph again. Running it again after a
cache hit only re-saves if something new was compiled.

Replicas load only files signed with their own key (`encoder_graphs/cache_trust.py`), so this
signs with the key they will use: `graphs.compile_cache_key_file` of the config (or
`--key-file`), the file every node of a cluster holds. Without one it signs with this machine's
own key (`$XDG_STATE_HOME/vlm-encoder-serve/compile-cache.key`), which only replicas on this
machine trust.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

import torch

from encoder_graphs.cache_trust import CacheKeyError, signer
from encoder_graphs.runner import EncoderRunner

from ..app import deployment_ladder
from ..config import AppConfig
from ..validation import BUILD_APP, serve_config_apps
from .replica import load_encoder


def app_config(path: str, app: str | None = None) -> AppConfig:
    """The `args` of the application built by `deployments.app:build_app` in a Serve config file."""
    apps = [(name, args) for name, args in serve_config_apps(path) if app is None or name == app]
    if len(apps) != 1:
        found = [name for name, _ in apps]
        raise SystemExit(f"{path}: expected one application built by {BUILD_APP}, found {found}; pick one with --app")
    return AppConfig.model_validate(apps[0][1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n")[-1])
    parser.add_argument("--config", required=True, help="Serve config YAML (e.g. configs/gpu.yaml)")
    parser.add_argument("--app", help="application name, when the file has several")
    parser.add_argument("--dir", help="cache directory (default: the config's graphs.compile_cache)")
    parser.add_argument(
        "--key-file",
        help="the key replicas will verify the cache with (default: the config's graphs.compile_cache_key_file; "
        "none: this machine's own key, trusted only by replicas on this machine)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = app_config(args.config, args.app)
    graphs = config.graphs
    if args.dir is not None:
        graphs = dataclasses.replace(graphs, compile_cache=args.dir)
    if args.key_file is not None:
        graphs = dataclasses.replace(graphs, compile_cache_key_file=args.key_file)
    if not graphs.compile or graphs.compile_cache is None:
        raise SystemExit("set graphs.compile: true and graphs.compile_cache (or --dir): there is nothing to cache")
    config = config.model_copy(update={"graphs": graphs})
    if config.model.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this machine has no CUDA GPU: run it on a GPU of the kind that will serve")
    try:
        key = signer(graphs.compile_cache_key_file, graphs.compile_cache)
    except CacheKeyError as error:
        raise SystemExit(str(error)) from None
    if key is None:
        raise SystemExit("this machine's compile cache key cannot be used (see the warning above); give --key-file")
    logging.info("signing with %s", key.source)
    if graphs.compile_cache_key_file is None:
        logging.warning(
            "no graphs.compile_cache_key_file: only replicas on this machine will trust what is saved; "
            "for a cluster, give the key file its nodes hold (--key-file or the config)"
        )
    start = time.perf_counter()
    encoder = load_encoder(config)
    runner = EncoderRunner(encoder, graphs, deployment_ladder(config))
    runner.prepare(progress=logging.info)
    status = runner.warm_up(progress=logging.info)
    print(f"compile cache {runner.compile_cache.path}: warm-up {status.stage} in {time.perf_counter() - start:.0f} s")
    return 0 if status.full_speed else 1


if __name__ == "__main__":
    sys.exit(main())
