"""Any head and token count wired into xfuser (cocodiff_xfuser/xfuser/padded.py): padding's state
belongs to the job that pads."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from cocodiff_xfuser import padding


def test_a_transformer_reused_by_a_later_job_pads_with_that_jobs_exchanger(monkeypatch):
    """FLUX's tokens padded to the degree, V-First off: a transformer's first padded forward in a
    job installs cocodiff's processors with that job's exchanger. A later job reusing the
    transformer gets its own (the first job's, closed, would send every layer to the stock
    processor, which cannot split padded tokens), and reads its own padding."""
    import xfuser.core.distributed as distributed

    from cocodiff_xfuser.processors import families
    from cocodiff_xfuser.xfuser import job, padded

    monkeypatch.setattr(distributed, "get_ring_parallel_world_size", lambda: 1)
    monkeypatch.setattr(distributed, "get_sequence_parallel_world_size", lambda: 3)
    monkeypatch.setattr(families, "agree_fused_kernels", lambda: None)  # (a collective over the world)
    jobs = [SimpleNamespace(padding=padding.Padding()) for _ in range(2)]  # two jobs' exchangers
    running = {}
    seen = []

    def forward(self, hidden_states, encoder_hidden_states=None, img_ids=None, txt_ids=None):
        seen.append((self.attn.processor.exchanger, running["job"].padding.running))
        return (hidden_states,)

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.processor = type("xFuserFluxAttnProcessor", (), {})()
    padding_forward = padded._padding_forward(forward)
    for current in jobs:
        running["job"] = current
        monkeypatch.setattr(job, "exchanger", lambda: current)
        # 7 image and 4 text tokens over 3 ranks: padded to 9 and 6, the image trimmed back.
        (out,) = padding_forward(model, torch.zeros(1, 7, 4), torch.zeros(1, 4, 4))
        assert out.shape == (1, 7, 4)
        assert seen[-1] == (current, padding.streams((4, 7), 3))
        assert current.padding.running is None and current.padding.tokens_were_padded()
    assert not jobs[0].padding.required() and type(model.attn.processor).__name__ == "FluxVFirstProcessor"
