"""Whether V-Major's Triton kernels write the torch reference's bytes: the int4 residuals' encode
and apply, the per-token change sums its ranking reads, the ranking and the choice of tokens, and
the sparse exchange's mask decode.

Each runs as the ``cocodiff_kernels`` operator V-Major calls. On an accelerator the compiled
kernels run beside the reference; on a CPU the Triton interpreter runs them, in a process of its own (it needs ``TRITON_INTERPRET=1`` before triton is first
imported). Cases cover float32 and bf16 values, rows of widths that are and are not powers of two
and multiples of the group, selected rows in any order and every row in order, a group that did
not change, the change sums of a Ulysses exchange's V (per batch and token, or per token) and
of a ring's K/V for every quantity, the ranks of a V's tokens (ties among them) with the budget's
count and of float64 changes, the top tokens and their mask, and the sparse exchange's mask decode
(one mask, or a run of sources' masks ahead of their rows).

``python -m cocodiff_xfuser.tools.kernel_check [--device cuda]`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

from cocodiff_xfuser.comm import mask_kernels, residual_kernels, residuals, sparse
from cocodiff_xfuser.vmajor import change_kernels, policy, rank_kernels

#: (shape, dtype): V as a Ulysses exchange holds it ([W, 1, b, h/W, s, d]), a ring's K/V
#: ([2, T, row], a row not a power of two), a row narrower than a group.
CASES = [((4, 1, 1, 2, 24, 64), dt) for dt in (torch.float32, torch.bfloat16)] + [
    ((2, 10, 96), torch.float32), ((2, 10, 96), torch.bfloat16), ((3, 7, 8), torch.float32)]
#: (shape, dims summed): V's chunks for other nodes ([W', 1, b, h/W, s, d]) per batch and token,
#: and per token; a ring's K/V ([2, T, row]) per token.
SUM_CASES = [((2, 1, 2, 3, 20, 64), (0, 1, 3, 5)), ((2, 1, 2, 3, 20, 64), (0, 1, 2, 3, 5)), ((2, 12, 320), (0, 2))]
#: (tokens, rows marked): masks whose bits fill whole bytes or not, a few rows or most.
MASK_CASES = [(20, 1), (37, 12), (64, 63), (300, 150)]
#: (tokens, budget's error bound): a V's chunks for other nodes ranked by change, their budget
#: counted, and the top tokens chosen; a bound that leaves most tokens out and one that leaves few.
RANK_CASES = [(20, 0.02), (77, 0.01), (300, 0.004)]


def compare(device: torch.device) -> dict:
    """Every case's encode (payload and updated reference) and apply, kernels against reference."""
    if not residual_kernels.usable(torch.empty(0, device=device)):
        return {"triton_matches_reference": None, "why": "no triton for this device (or no interpreter)"}
    g = torch.Generator().manual_seed(2)
    failed = []
    for shape, dtype in CASES:
        x = torch.randn(shape, generator=g).to(dtype)
        reference = (x.float() + 0.03 * torch.randn(shape, generator=g)).to(dtype)
        reference[..., 0, : shape[-1] // 2] = x[..., 0, : shape[-1] // 2]  # a group that did not change
        x, reference = x.to(device), reference.to(device)
        dim = len(shape) - 2
        for rows in (torch.tensor([5, 0, 1, 3], device=device), torch.arange(shape[dim], device=device)):
            every = rows.numel() == shape[dim]
            sent_ref, sent_k = reference.clone(), reference.clone()
            payload_ref, new = residuals.encode_int4(x.index_select(dim, rows), reference.index_select(dim, rows))
            sent_ref.index_copy_(dim, rows, new)
            payload_k = torch.ops.cocodiff_kernels.int4_encode(x, sent_k, rows)
            held_ref, held_k = reference.clone(), reference.clone()
            held_ref.index_copy_(dim, rows, residuals.add_int4(held_ref.index_select(dim, rows), payload_ref))
            torch.ops.cocodiff_kernels.int4_apply(held_k, payload_k, None if every else rows)
            same = (torch.equal(payload_k, payload_ref), torch.equal(sent_k, sent_ref), torch.equal(held_k, held_ref),
                    torch.equal(held_k, sent_k))
            if not all(same):
                failed.append({"shape": list(shape), "dtype": str(dtype), "every_row": every,
                               "payload, reference, apply, copies equal": same})
    cases = 2 * len(CASES)
    for shape, dims in SUM_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=g).to(dtype)
            reference = (x.float() + 0.05 * torch.randn(shape, generator=g)).to(dtype)
            x, reference = x.to(device), reference.to(device)
            for kinds in (("squared change", "squared reference"), ("absolute change", "squared value")):
                got = torch.ops.cocodiff_kernels.change_sums(x, reference, *kinds, list(dims))
                want = policy.reference_sums(kinds, x, reference, dims)
                cases += 1
                if not (change_kernels.usable(x, reference) and torch.equal(got[0], torch.stack([a for a, _ in want]))
                        and torch.equal(got[1], torch.stack([sa for _, sa in want]))):
                    failed.append({"shape": list(shape), "dims": list(dims), "dtype": str(dtype), "sums": list(kinds)})
    for s, k in MASK_CASES:
        for n in (None, 3):  # one mask, or a run of sources' pieces: masks ahead of their rows
            chosen = [torch.randperm(s, generator=g)[:k].sort().values for _ in range(n or 1)]
            masks = torch.stack([sparse.Selection.fixed(c, 1).mask(s) for c in chosen])
            pieces = torch.cat([masks, torch.zeros(masks.shape[0], 5, dtype=torch.uint8)], dim=1).to(device)
            mask = pieces[0, : masks.shape[1]] if n is None else pieces[:, : masks.shape[1]]
            cases += 1
            got = torch.ops.cocodiff_kernels.mask_rows(mask, s, k)
            if not (mask_kernels.usable(mask) and torch.equal(got, sparse.reference_rows_of(mask, s, k))):
                failed.append({"mask of": s, "rows": k, "masks": n or 1})
    for s, bound in RANK_CASES:
        x = torch.randn(2, 1, 1, 3, s, 16, generator=g)
        reference = x + 0.05 * torch.randn(x.shape, generator=g) * torch.rand(s, 1, generator=g)
        (squared, scale), (norms, norm_scale) = policy.reference_sums(("squared change", "squared value"), x, reference,
                                                                      (0, 1, 2, 3, 5))
        squared[::3] = squared[1]  # ties, broken by token index
        budget = tuple(t.to(device) for t in (norms, scale, norm_scale)) + (bound**2,)
        keys = squared.to(device)
        got, want = torch.ops.cocodiff_kernels.budget_ranks(keys, *budget), policy.reference_ranks(keys, budget)
        change = squared.to(device).double() / 3  # float64 keys, as the threshold policy ranks
        cases += 1
        if not (rank_kernels.usable(keys) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                and torch.equal(torch.ops.cocodiff_kernels.ranks(change), policy.reference_ranks(change)[0])):
            failed.append({"ranks of": s, "bound": bound})
        for k in (1, s // 3, s - 1):
            cases += 1
            got = torch.ops.cocodiff_kernels.top(want[0], k)
            if not all(torch.equal(a, b) for a, b in zip(got, policy.reference_top(want[0], k))):
                failed.append({"top": k, "of": s})
    return {"triton_matches_reference": not failed, "cases": cases, "failed": failed,
            "device": str(device), "interpreted": os.environ.get("TRITON_INTERPRET") == "1"}


def interpreted(timeout: float = 300) -> dict:
    """:func:`compare` on the CPU under the Triton interpreter, in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", __name__], env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        return {"triton_matches_reference": False, "why": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cocodiff_xfuser.tools.kernel_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    report = compare(torch.device(args.device))
    print(json.dumps(report))
    return 0 if report["triton_matches_reference"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
