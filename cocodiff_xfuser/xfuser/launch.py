"""Errors before launch: the ``xdit`` CLI checks cocodiff's flags before torchrun starts a worker.

``xdit`` (``xfuser.cli.main``) hands its arguments to torchrun, whose workers parse them; a mistake
found there ends every worker, and torchrun then prints its own failure report under the one line.
What needs no ranks is checked in the ``xdit`` process first, with the workers' own code: the flags
and V-Major knobs (:func:`.flags.options`), and a topology given with ``--cocodiff-topology`` against
the world torchrun would start. A mistake is one line on stderr and exit status 2; nothing starts.
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

from cocodiff_xfuser import compat, errors
from cocodiff_xfuser.comm import topology
from cocodiff_xfuser.xfuser import flags


def patch_cli(cli: types.ModuleType) -> None:
    compat.wrap(cli, "main", lambda original: _checking_first(cli, original))


def _checking_first(cli: types.ModuleType, original):
    def main(args: list[str] | None = None) -> Any:
        argv = sys.argv[1:] if args is None else args
        if flags.cocodiff_requested(argv):
            problem = launch_error(cli, argv)
            if problem is not None:
                print(errors.as_line(problem), file=sys.stderr, flush=True)
                sys.exit(2)
        return original(args)

    return main


def launch_error(cli: types.ModuleType, argv: list[str]) -> str | None:
    """What is wrong with ``xdit argv`` for the cocodiff backend that no rank is needed to see (None:
    nothing found here; the workers check the rest)."""
    torchrun, runner_args = cli.extract_torchrun_args(argv)
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False, allow_abbrev=False)
    flags.add_backend_args(parser)
    parser.add_argument("--use_fp8_comms", "--use-fp8-comms", action="store_true")  # xfuser's, read beside cocodiff's
    try:
        given, _ = parser.parse_known_args(runner_args)
        flags.options(given)
    except (argparse.ArgumentError, ValueError) as e:
        return str(e)
    spec = given.cocodiff_topology
    if spec in (None, "", "auto"):
        return None  # detected by the workers, from their hosts
    try:
        nproc = int(torchrun["--nproc_per_node"] or cli.get_nproc_from_args(runner_args))
        world = nproc * int(torchrun["--nnodes"])
    except ValueError:
        return None  # torchrun's own values ("gpu", a node range): torchrun reports them
    try:
        topology.resolve(spec, world)
    except (ValueError, OSError) as e:
        return str(e)  # the workers' line: it names the topology
    return None
