"""One command line for the service's tools: `python -m deployments <tool> ...` (or `vlm-encoder-serve <tool>`).

validate FILE.yaml ...        check Serve config files without starting anything
compile-cache --config FILE   fill a compile cache on this GPU, signed for the replicas
config-reference [--write F]  the configuration table (docs/configuration.md)
"""

from __future__ import annotations

import sys

TOOLS = {
    "validate": ("deployments.validation", "check Serve config files without starting anything"),
    "compile-cache": ("deployments.encoder.compile_cache", "fill a compile cache on this GPU, signed for the replicas"),
    "config-reference": ("deployments.config", "print (or --write into a file) the configuration table"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the named tool with the remaining arguments; imports only that tool (validation stays light)."""
    import importlib

    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in TOOLS:
        usage = "\n".join(f"  {name:<17} {what}" for name, (_, what) in TOOLS.items())
        stream = sys.stdout if args[:1] in (["-h"], ["--help"]) else sys.stderr
        print(f"usage: python -m deployments <tool> [arguments]\n\n{usage}", file=stream)
        return 0 if stream is sys.stdout else 2
    module = importlib.import_module(TOOLS[args[0]][0])
    return module.main(args[1:])
