"""Benchmark: the dry run of a Llama-3-8B-shaped model at 1024 ranks, on this machine's CPU.

    python benchmarks/dry_run.py [--json out.json] [--seq-len 8192] [--batch-size 8] [--ranks 0,1023]

The pack's GPT (``lightning_dist.models.gpt.CharGPT``) shaped like Llama 3 8B: 32 blocks, width 4096,
32 query heads, 8 key/value heads (grouped-query attention), vocabulary 128256, no biases (its MLP is the
pack's GELU ``fc1 -> fc2`` of width 4 x 4096, not Llama's SwiGLU of 14336, so it has 6.7e9 parameters).
Layout: ``strategy="pipeline"`` with pp=4 x dp_replicate=4 x dp_shard=8 x tp=8 on 128 nodes of 8 devices,
bf16-mixed, 1F1B with 8 micro-batches, ``--batch-size`` samples per data-parallel rank of ``--seq-len``
tokens. Each representative rank (first rank of every stage, and the last rank) runs in its own process,
one after the other. Prints the dry run's tables and, per rank: seconds, model-state bytes measured /
planned, peak activation bytes measured / :func:`lightning_dist.planner.activation_bytes`, and the worst
collective measured / planned over the (op, mesh dim) pairs.
"""

from __future__ import annotations

import argparse
import json
import time

from lightning_dist.dryrun import DryRunConfig, dry_run

LLAMA3_8B_SHAPE = {
    "vocab_size": 128256,
    "block_size": 8192,
    "n_layer": 32,
    "n_head": 32,
    "n_kv_head": 8,
    "n_embd": 4096,
    "mlp_ratio": 4,
    "bias": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=8, help="samples per data-parallel rank per step")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks (default: the representative ones)")
    parser.add_argument("--json", default=None, help="write the report as JSON here")
    args = parser.parse_args()
    config = DryRunConfig(
        model="lightning_dist.models.gpt.CharGPT",
        init_args=LLAMA3_8B_SHAPE,
        strategy="pipeline",
        strategy_args={"pp": 4, "dp_replicate": 4, "dp_shard": 8, "tp": 8, "split": "params"},
        world_size=1024,
        devices_per_node=8,
        precision="bf16-mixed",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device_memory=80e9,
        ranks=tuple(int(r) for r in args.ranks.split(",")) if args.ranks else None,
    )
    start = time.perf_counter()
    report = dry_run(config, timeout=1200)
    print(report.format())
    summary = []
    for r in report.ranks:
        comm = report.collective_ratios(r)
        worst = max((abs(m / p - 1), op, dim) for (op, dim), (m, p) in comm.items() if p)
        row = {
            "rank": r["rank"],
            "seconds": round(r["seconds"], 1),
            "states_measured_over_planned": r["states"]["total"] / r["planned"]["states"]["total"],
            "activation_measured_over_planned": r["peak_activation_bytes"] / r["planned"]["peak_activation_bytes"],
            "worst_collective_deviation": worst[0],
            "worst_collective": f"{worst[1]} on {worst[2]}",
            "fits_80GB": report.fits(r),
        }
        summary.append(row)
        print(json.dumps(row))
    print(f"total {time.perf_counter() - start:.0f} s for {len(report.ranks)} ranks")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report.to_dict(), "summary": summary}, f, indent=2)


if __name__ == "__main__":
    main()
