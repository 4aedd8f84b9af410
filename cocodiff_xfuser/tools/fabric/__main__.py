"""``python -m cocodiff_xfuser.tools.fabric``: the preset numbers for emulate_cluster.sh, and bounds."""

import sys

from cocodiff_xfuser.tools.fabric import main

sys.exit(main())
