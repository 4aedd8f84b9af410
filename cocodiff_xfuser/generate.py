"""One image generation through xfuser's own runner, as ``xdit`` does it; run under torchrun.

``python -m cocodiff_xfuser.generate --out DIR <xdit runner flags>`` runs the pipeline with
exactly the flags a user would give ``xdit`` and, on the last rank (the one xfuser saves
from), writes ``images.npy`` (float images in [0, 1]) and ``result.json`` (timings, config).
``verify``, ``demo`` and the benchmarks compare such outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--out", required=True, type=Path)
    ours.add_argument("--save-png", action="store_true")
    mine, runner_argv = ours.parse_known_args(argv)

    from xfuser.config import FlexibleArgumentParser
    from xfuser.core.utils.runner_utils import is_last_process
    from xfuser import xFuserArgs
    from xfuser.runner import xFuserModelRunner

    args = vars(xFuserArgs.add_runner_args(FlexibleArgumentParser()).parse_args(runner_argv))
    runner = xFuserModelRunner(args)
    input_args = runner.preprocess_args(args)
    input_args["output_type"] = "np"
    runner.initialize(input_args)
    output, timings = runner.run(input_args)
    if is_last_process():
        mine.out.mkdir(parents=True, exist_ok=True)
        images = np.stack([np.asarray(image) for image in output.images])
        np.save(mine.out / "images.npy", images)
        if mine.save_png:
            from diffusers.utils import numpy_to_pil

            for i, image in enumerate(numpy_to_pil(images)):
                image.save(mine.out / f"image_{i}.png")
        result = {
            "model": args["model"],
            "sp_backend": args.get("sp_backend"),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "seconds": timings[-1] if timings else None,
        }
        (mine.out / "result.json").write_text(json.dumps(result))
    runner.cleanup()


if __name__ == "__main__":
    main()
