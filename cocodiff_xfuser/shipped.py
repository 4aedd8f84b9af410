"""Where the files shipped with the package live.

``configs/`` (topology presets, V-Major's policies and calibration) sits at the top of the source
tree and is installed into the wheel as ``cocodiff_xfuser/configs`` (pyproject.toml): one copy,
found from either place.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
#: The shipped configuration directory: in the installed wheel, or in the checkout.
CONFIGS = _PACKAGE / "configs" if (_PACKAGE / "configs").is_dir() else _PACKAGE.parent / "configs"
