"""Every tile of the mma_v2 sparse decoding kernel on the bench's V3.2 decoding shapes, each call checked against
the PyTorch reference (FlashMLA's tolerances) before it is timed:

    DISABLE_MMA_V3=1 python -m anymla.triton_kernels.ampere.time_tiles [--case NAME ...] [--csv FILE]

Tiles: ``decode_launch.TILES`` and ``ONE_TILE`` that fit the GPU, each with the split count the launch picks; the
bench's inputs, timer and cost model; the compute ceiling is the same-setting Triton matmul (under
``DISABLE_MMA_V3=1`` the mma.sync one, as in ``bench --mma-sync``). How a tile is chosen and what was measured:
``NOTES.md``.
"""

from __future__ import annotations

import argparse
import csv

import torch

import anymla
from anymla.bench import machine, model
from anymla.bench.ceilings import measure_ceilings
from anymla.bench.suites import build_inputs, suite_cases
from anymla.bench.timing import Timer
from anymla.testing import compare_outputs

from .decode_launch import ONE_TILE, TILES, decode_shared_bytes, sparse_decode

CASES = ("sdecode-v32-b128-sq2-h128", "sdecode-v32-b64-sq1-h64")


def run(case_names, reps: int, csv_path) -> list[dict]:
    device = torch.device("cuda")
    timer = Timer(device, reps)
    ceilings = measure_ceilings(device, timer, machine.stand_in(True))
    print(f"ceilings: {ceilings.describe()}", flush=True)
    smem = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    rows = []
    for case in suite_cases("canonical-sparse-decode"):
        if case.name not in (case_names or CASES):
            continue
        _, args = build_inputs(case, device)
        expected = anymla.flash_mla_with_kvcache(**{**args, "tile_scheduler_metadata": None}, backend="reference")
        cost = model.cost(case.op, args)
        for tile in (t for t in TILES + ONE_TILE if decode_shared_bytes(t) <= smem):
            def call(tile=tile):
                return sparse_decode(args["q"], args["k_cache"], args["indices"], args["softmax_scale"],
                                     topk_length=args.get("topk_length"), attn_sink=args.get("attn_sink"), tile=tile)
            row = dict(device=torch.cuda.get_device_name(), case=case.name, tile=f"{tile[0]} keys x{tile[1]}")
            try:
                compare_outputs("sparse_decode", call(), expected)
                t = timer.measure(call)
                r = model.rates(cost, t.median_us, ceilings)
                row.update(status="ok", us=round(t.median_us, 1), x_matmul=round(r.ratio_to_matmul, 3),
                           x_copy=round(r.ratio_to_copy, 3))
            except Exception as e:
                row.update(status=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(row)
            print(row, flush=True)
        del args, expected
        torch.cuda.empty_cache()
    if csv_path and rows:
        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
            writer.writeheader()
            writer.writerows(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help=f"cases of the canonical-sparse-decode suite (default: {CASES})")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--csv")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the mma_v2 kernels run on NVIDIA GPUs only; no CUDA device here")
    run(a.case, a.reps, a.csv)


if __name__ == "__main__":
    main()
