"""The ``--sp-backend`` flag and cocodiff's options on both xfuser entry paths, carried into
``runtime_config`` (readable as ``get_runtime_state().runtime_config.<name>``)."""

from __future__ import annotations

import os
import sys
import types

from cocodiff_xfuser import compat, settings
from cocodiff_xfuser.comm import faults
from cocodiff_xfuser.settings import Options, VMajorSettings

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


#: A settings field's type (its annotation's text) -> what argparse converts the flag's value with.
_TYPES = {"str": str, "str | None": str, "float": float, "int": int}


def add_backend_args(parser) -> None:
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
    for name, f in settings.flags(Options):
        meta = f.metadata
        # A setting read from the environment is None when not given (:func:`options` reads it).
        kind = {"action": "store_true"} if f.type == "bool" else {
            "type": _TYPES[f.type], "default": None if meta["env"] else f.default, "choices": meta["choices"],
            "metavar": meta["metavar"]}
        group.add_argument(f"--cocodiff_{name}", f"--cocodiff-{name.replace('_', '-')}", help=f"cocodiff: {meta['help']}.", **kind)
    group.add_argument(
        "--cocodiff_v_major",
        "--cocodiff-v-major",
        choices=settings.MODES,
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
        f"(default {settings.DEFAULT_MIN_PSNR_DB:g}; calibrated on the trained models, {settings.CALIBRATION.name}).",
    )
    group.add_argument(
        "--cocodiff_v_major_config",
        "--cocodiff-v-major-config",
        default=None,
        metavar="YAML",
        help=f"cocodiff: V-Major settings file (default {settings.DEFAULTS.name}, shipped); the flags below override it.",
    )
    for knob in settings.knobs():
        group.add_argument(
            f"--cocodiff_v_major_{knob.name}",
            f"--cocodiff-v-major-{knob.name.replace('_', '-')}",
            type=_TYPES[knob.type],
            default=None,
            help=f"cocodiff: V-Major {knob.metadata['help']} (default: the settings file).",
        )


BACKEND_KEYS = (
    "sp_backend", *(f"cocodiff_{name}" for name, _ in settings.flags(Options)),
    "cocodiff_v_major", "cocodiff_v_major_config", "cocodiff_v_major_min_psnr",
    *(f"cocodiff_v_major_{knob.name}" for knob in settings.knobs()),
)


def options(runtime_config) -> Options:
    """The backend's options the flags ask for (a flag not given, on the runner's path: the
    setting's default; the timeout's comes from the environment); ValueError for bad ones."""
    given = {f.name: getattr(runtime_config, f"cocodiff_{name}", None) for name, f in settings.flags(Options)}
    given = {key: value for key, value in given.items() if value is not None}
    given.setdefault("timeout_s", faults.default_timeout_s())
    v_major = v_major_settings(runtime_config)
    if getattr(runtime_config, "use_fp8_comms", False):
        # xfuser's fp8 communication lives in its own attention processors (V-First falls back to them).
        if v_major is not None:
            raise ValueError("--use_fp8_comms with --cocodiff-v-major: xfuser's fp8 communication runs in its own attention "
                             "processors, which V-Major replaces with cocodiff's; choose one")
        if given.get("compress", "none") != "none":
            raise ValueError(f"--use_fp8_comms with --cocodiff-compress {given['compress']}: both compress the Ulysses "
                             "exchanges; choose one")
    # V-Major implies V-First.
    return Options(**{**given, "v_first": bool(given.get("v_first")) or v_major is not None}, v_major=v_major)


def v_major_settings(runtime_config) -> VMajorSettings | None:
    """The V-Major settings the flags ask for (None: off); ValueError for bad ones."""
    mode = getattr(runtime_config, "cocodiff_v_major", None) or "off"
    min_psnr = getattr(runtime_config, "cocodiff_v_major_min_psnr", None)
    if min_psnr is not None and mode != "auto":
        raise ValueError("--cocodiff-v-major-min-psnr needs --cocodiff-v-major auto")
    if mode == "off":
        return None
    overrides = {knob.name: getattr(runtime_config, f"cocodiff_v_major_{knob.name}", None) for knob in settings.knobs()}
    if mode == "auto":
        chosen = [f"--cocodiff-v-major-{name}" for name in ("policy", "error") if overrides[name] is not None]
        if chosen:
            raise ValueError(f"--cocodiff-v-major auto sets {' and '.join(chosen)} itself, from --cocodiff-v-major-min-psnr: "
                             f"leave {'them' if len(chosen) > 1 else 'it'} out")
        min_psnr = settings.DEFAULT_MIN_PSNR_DB if min_psnr is None else min_psnr
        overrides.update(policy="budget", error=settings.error_for(min_psnr))
    return VMajorSettings.load(getattr(runtime_config, "cocodiff_v_major_config", None), min_psnr_db=min_psnr, strict=True,
                               **overrides)


def patch_args(args_module: types.ModuleType) -> None:
    cls = compat.target(args_module, "xFuserArgs")

    def adding_flags(original):
        def add_args(parser):
            parser = original(parser)
            if "--sp_backend" not in parser._option_string_actions:
                add_backend_args(parser)
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
