"""Where the files shipped with the package live.

``configs/`` (topology presets, V-Major's policies and calibration) sits at the top of the source
tree and is installed into the wheel as ``cocodiff_xfuser/configs``; the a2a measurements the
planner is fitted on (``docs/results/a2a-<fabric>-<shape>.json``) and the V-Major sweep it prices
V-Major from as ``cocodiff_xfuser/results``
(pyproject.toml). One copy of each, found from either place.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
#: The shipped configuration directory: in the installed wheel, or in the checkout.
CONFIGS = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
#: The shipped measurements (``cocodiff plan``): in the installed wheel, or the checkout's docs/results.
RESULTS = _PACKAGE / "results" if (_PACKAGE / "results").is_dir() else _PACKAGE.parent / "docs" / "results"
