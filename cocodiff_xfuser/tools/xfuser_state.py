"""xfuser's runtime state for a transformer called without a pipeline: what the tools and test
workers that run one directly need (xfuser's own setter wants a pipeline)."""

from __future__ import annotations

from typing import Any

from cocodiff_xfuser import compat


def install(engine_config: Any, text_tokens: int | None = None) -> None:
    """xfuser's DiT runtime state for ``engine_config``, its groups already built; ``text_tokens``:
    the text's tokens, which FLUX's pipeline sets per request."""
    from xfuser.core.distributed import runtime_state

    class State(runtime_state.DiTRuntimeState):
        def __init__(self, config) -> None:
            runtime_state.RuntimeState.__init__(self, config)
            self.step_counter = None
            self.split_text_embed_in_sp = True
            self.text_embed_sp_pad = 0
            if text_tokens is not None:
                self.max_condition_sequence_length = text_tokens

        def _check_distributed_env(self, parallel_config) -> None:
            pass  # the groups exist already; whoever calls starts cocodiff's job, where it wants one

    compat.set_private("xfuser.core.distributed.runtime_state", "_RUNTIME", State(engine_config))
