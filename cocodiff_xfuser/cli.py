"""The ``cocodiff`` command: ``verify``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import logging
import sys

from cocodiff_xfuser import tiny_models


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cocodiff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    verify = sub.add_parser("verify", help="stock Ulysses vs cocodiff on a tiny model, same seed, compared")
    verify.add_argument("--model", required=True, choices=sorted(tiny_models.SPECS))
    verify.add_argument("--ulysses-degree", type=int, required=True)
    verify.add_argument("--ring-degree", type=int, default=1)
    verify.add_argument("--topology", default=None, help="emulated NxL[xT] (nodes x ranks per node [x tiles])")
    verify.add_argument("--steps", type=int, default=None)
    verify.add_argument("--v-first", action="store_true", help="cocodiff with V-First processors")
    verify.add_argument("--timeout", type=float, default=600.0, help="seconds per torchrun job")
    verify.add_argument("--json", action="store_true", help="print one JSON object")

    demo = sub.add_parser("demo", help="tiny FLUX on 4 CPU ranks (2 nodes x 2), stock vs cocodiff")
    demo.add_argument("--out", default="demo-output", help="directory for the two images and the report")
    demo.add_argument("--size", type=int, default=128, help="image height and width")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--timeout", type=float, default=900.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args, extra = _parser().parse_known_args(argv)
    if args.command == "verify":
        from cocodiff_xfuser import verify

        return verify.main(args, extra)
    if args.command == "demo":
        from cocodiff_xfuser import demo

        return demo.main(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
