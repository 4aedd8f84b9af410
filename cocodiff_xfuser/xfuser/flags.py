"""The ``--sp-backend`` flag and cocodiff's options on both xfuser entry paths, carried into
``runtime_config`` (readable as ``get_runtime_state().runtime_config.<name>``)."""

from __future__ import annotations

import os
import sys
import types

from cocodiff_xfuser import vmajor
from cocodiff_xfuser.comm import compress, faults
from cocodiff_xfuser.comm.registry import A2A_SETTINGS
from cocodiff_xfuser.xfuser import compat

BACKEND_ENV = "XFUSER_SP_BACKEND"
SP_BACKENDS = ("ulysses", "cocodiff")


def cocodiff_requested(argv: list[str] | None = None) -> bool:
    """Whether this process asked for the cocodiff backend: the flag, else the environment."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key in ("--sp-backend", "--sp_backend"):
            return (value or (argv[i + 1] if i + 1 < len(argv) else "")) == "cocodiff"
    return env_backend() == "cocodiff"


def env_backend() -> str:
    """``$XFUSER_SP_BACKEND``, normalized (default ``ulysses``)."""
    return os.environ.get(BACKEND_ENV, "").strip().lower() or "ulysses"


def _add_backend_args(parser) -> None:
    group = parser.add_argument_group("cocodiff-xfuser")
    default = env_backend()
    if default not in SP_BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={default!r}: expected one of {', '.join(SP_BACKENDS)}")
    group.add_argument(
        "--sp_backend",
        "--sp-backend",
        choices=SP_BACKENDS,
        default=default,
        help=f"Sequence-parallel backend: stock 'ulysses' or 'cocodiff' (default from ${BACKEND_ENV}, else ulysses).",
    )
    group.add_argument(
        "--cocodiff_topology",
        "--cocodiff-topology",
        default=None,
        help="cocodiff: hardware levels as NxL[xT] (nodes x ranks per node [x tiles]), a preset (aurora, "
        "dgx-h100, dgx-h200, pcie-8gpu) or preset file, or 'auto' (detected from hostnames and LOCAL_WORLD_SIZE; the default).",
    )
    group.add_argument(
        "--cocodiff_a2a",
        "--cocodiff-a2a",
        choices=A2A_SETTINGS,
        default="auto",
        help="cocodiff: all-to-all algorithm; 'auto' measures the eligible ones per message size against the backend's fair flat exchange.",
    )
    group.add_argument(
        "--cocodiff_v_first",
        "--cocodiff-v-first",
        action="store_true",
        help="cocodiff: V-First attention processors (V's exchange overlaps Q/K projection, norm and RoPE).",
    )
    group.add_argument(
        "--cocodiff_timeout",
        "--cocodiff-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"cocodiff: bound on every exchange; a stalled or dead peer ends the job with one line "
        f"(default ${faults.TIMEOUT_ENV}, else {faults.DEFAULT_TIMEOUT_S:g}).",
    )


    group.add_argument(
        "--cocodiff_compress",
        "--cocodiff-compress",
        choices=compress.SETTINGS,
        default="none",
        help="cocodiff: fp8: every Ulysses exchange in fp8 with one scale per token and head (lossy, on every link); "
        "fp8-slow: the same on links to other nodes only, node-mates get exact values (compared with V-Major in "
        "docs/benchmarks.md).",
    )
    group.add_argument(
        "--cocodiff_v_major",
        "--cocodiff-v-major",
        choices=vmajor.MODES,
        default="off",
        help="cocodiff: V-Major: over slow links send only the tokens whose V changed (lossy; implies V-First); "
        "auto: the fewest tokens per layer that meet --cocodiff-v-major-min-psnr.",
    )
    group.add_argument(
        "--cocodiff_v_major_min_psnr",
        "--cocodiff-v-major-min-psnr",
        type=float,
        default=None,
        metavar="DB",
        help=f"cocodiff: with --cocodiff-v-major auto, the PSNR (dB, against the exact run) to keep "
        f"(default {vmajor.DEFAULT_MIN_PSNR_DB:g}; calibrated on the trained models, {vmajor.CALIBRATION.name}).",
    )
    group.add_argument(
        "--cocodiff_v_major_config",
        "--cocodiff-v-major-config",
        default=None,
        metavar="YAML",
        help=f"cocodiff: V-Major settings file (default {vmajor.DEFAULTS.name}, shipped); the flags below override it.",
    )
    for name, kind, help_text in V_MAJOR_KNOBS:
        group.add_argument(
            f"--cocodiff_v_major_{name}",
            f"--cocodiff-v-major-{name.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"cocodiff: V-Major {help_text} (default: the settings file).",
        )


#: The V-Major knobs with a flag each (``vmajor.Settings`` fields).
V_MAJOR_KNOBS = (
    ("policy", str, f"token selection: {', '.join(vmajor.POLICIES)}"),
    ("metric", str, f"change of a token: {', '.join(vmajor.METRICS)}"),
    ("threshold", float, "change above which a token is sent (policy threshold)"),
    ("error", float, "relative L2 error of V kept per layer (policy budget)"),
    ("fraction", float, "share of tokens sent per step (policy top-k)"),
    ("final_cached", float, "cached share reached at the last step (policy schedule)"),
    ("warmup_steps", int, "first steps exchanged in full"),
    ("refresh_every", int, "full exchange every this many steps (0: never)"),
    ("scope", str, f"exchanges the mask gates: {', '.join(vmajor.SCOPES)}"),
    ("residual_dtype", str, f"active rows over slow links: {', '.join(vmajor.RESIDUAL_DTYPES)} (none: values)"),
    ("budget_mib", float, "bound on the caches in MiB; layers beyond it use the exact exchange"),
    ("if_slower", str, f"auto, where its steps are not faster than exact steps: {', '.join(vmajor.IF_SLOWER)}"),
)

BACKEND_KEYS = (
    "sp_backend", "cocodiff_topology", "cocodiff_a2a", "cocodiff_v_first", "cocodiff_timeout", "cocodiff_compress",
    "cocodiff_v_major", "cocodiff_v_major_config", "cocodiff_v_major_min_psnr",
    *(f"cocodiff_v_major_{name}" for name, _, _ in V_MAJOR_KNOBS),
)


def v_major_settings(runtime_config) -> vmajor.Settings | None:
    """The V-Major settings the flags ask for (None: off); ValueError for bad ones."""
    mode = getattr(runtime_config, "cocodiff_v_major", None) or "off"
    min_psnr = getattr(runtime_config, "cocodiff_v_major_min_psnr", None)
    if min_psnr is not None and mode != "auto":
        raise ValueError("--cocodiff-v-major-min-psnr needs --cocodiff-v-major auto")
    if mode == "off":
        return None
    overrides = {name: getattr(runtime_config, f"cocodiff_v_major_{name}", None) for name, _, _ in V_MAJOR_KNOBS}
    if mode == "auto":
        chosen = [f"--cocodiff-v-major-{name}" for name in ("policy", "error") if overrides[name] is not None]
        if chosen:
            raise ValueError(f"--cocodiff-v-major auto sets {' and '.join(chosen)} itself, from --cocodiff-v-major-min-psnr: "
                             f"leave {'them' if len(chosen) > 1 else 'it'} out")
        min_psnr = vmajor.DEFAULT_MIN_PSNR_DB if min_psnr is None else min_psnr
        overrides.update(policy="budget", error=vmajor.error_for(min_psnr))
    return vmajor.Settings.load(getattr(runtime_config, "cocodiff_v_major_config", None), min_psnr_db=min_psnr, strict=True,
                                **overrides)


def patch_args(args_module: types.ModuleType) -> None:
    cls = compat.target(args_module, "xFuserArgs")

    def adding_flags(original):
        def add_args(parser):
            parser = original(parser)
            if "--sp_backend" not in parser._option_string_actions:
                _add_backend_args(parser)
            return parser

        return add_args

    compat.wrap(cls, "add_cli_args", adding_flags)
    compat.wrap(cls, "add_runner_args", adding_flags)

    # from_*_args keep only dataclass fields; carry ours across as plain attributes.
    def carrying(get):
        def make(original):
            def from_args(klass, args):
                engine_args = original(klass, args)
                for key in BACKEND_KEYS:
                    setattr(engine_args, key, get(args, key))
                return engine_args

            return from_args

        return make

    compat.wrap(cls, "from_cli_args", carrying(lambda args, key: getattr(args, key, None)))
    compat.wrap(cls, "from_runner_args", carrying(lambda args, key: args.get(key)))

    def make(original):
        def create_config(self):
            engine_config, input_config = original(self)
            for key in BACKEND_KEYS:
                setattr(engine_config.runtime_config, key, getattr(self, key, None))
            return engine_config, input_config

        return create_config

    compat.wrap(cls, "create_config", make)
