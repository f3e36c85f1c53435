"""H200 script: run one logits launch per case and keep what the compiler made of it.

    TRITON_CACHE_DIR=/tmp/tc python tools/device_profile.py --out DIR [--case decode64]
    ncu --clock-control none -k regex:logits -c 1 python tools/device_profile.py --case decode64
    (--schedule: decode cases launch the persistent scheduled kernel instead of the static grid)

Runs each selected case (dense decode H64 next_n 2 64 x 16K, dense decode H32 64 x 64K,
prefill H64 4096 x 32K) twice with no timing loop (so ncu can take exactly one launch), then
copies every compiled kernel's TTGIR, PTX and SASS (and `cuobjdump -res-usage`) from
TRITON_CACHE_DIR into DIR/artifacts.tgz. Reading those tells whether the MMA is a wgmma, where
its operands live and what each key costs in instructions; ncu says where the warps stall.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from graphidx.bench.inputs import random_block_table, random_kv_cache, random_queries
from graphidx.ops.kernels import logits as triton_logits
from graphidx.ops.kernels.logits import LogitsConfig
from graphidx.ops.schedule import allocate_schedule, build_decode_schedule

HEAD_DIM = 128
CASES = {
    # name: (heads, next_n, seqs, keys per seq, page_entries) or prefill rows with next_n 0
    "decode64": (64, 2, 64, 16384, 64),
    "decode32": (32, 2, 64, 65536, 128),
    "prefill": (64, 0, 4096, 32768, 64),
}


def run_case(
    name: str, device: torch.device, config: LogitsConfig | None = None, schedule: bool = False
) -> None:
    heads, next_n, count, keys, page_entries = CASES[name]
    prefill = next_n == 0
    contexts = [keys] if prefill else [keys] * count
    rows = count if prefill else count * next_n
    table, pages = random_block_table(contexts, page_entries, device)
    kv = random_kv_cache(pages, heads, HEAD_DIM, page_entries, device)
    q, q_scale, weights = random_queries(rows, heads, HEAD_DIM, device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    if prefill:
        ends = [keys - rows + r + 1 for r in range(rows)]
    else:
        ends = [c - (next_n - 1 - j) for c in contexts for j in range(next_n)]
    row_ends = torch.tensor(ends, dtype=torch.int32, device=device)
    out = torch.empty((rows, keys), device=device)
    grouping: dict[str, object] = (
        {"query_start_loc": torch.tensor([0, rows], dtype=torch.int32, device=device)}
        if prefill
        else {"next_n": next_n}
    )
    if schedule and not prefill:
        plan = allocate_schedule(count, keys, device)
        build_decode_schedule(row_ends, plan, next_n=next_n, backend="triton")
        grouping["schedule"] = plan
    for _ in range(2):
        triton_logits.paged_mqa_logits(
            q, q_scale, kv, weights, context_lens, table, row_ends, out,
            page_entries=page_entries, config=config, **grouping,  # type: ignore[arg-type]
        )  # fmt: skip
    torch.cuda.synchronize(device)
    print(f"{name}: ran", flush=True)


def collect_artifacts(cache_dir: Path, out_dir: Path) -> Path:
    """Tar every kernel's .ttgir/.ptx/.json from the Triton cache, plus SASS and resource
    usage dumped from each .cubin by cuobjdump."""
    out_dir.mkdir(parents=True, exist_ok=True)
    archive = out_dir / "artifacts.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(cache_dir.rglob("*")):
            if path.suffix in {".ttgir", ".ptx", ".json"}:
                tar.add(path, arcname=f"{path.parent.name[:8]}/{path.name}")
            if path.suffix == ".cubin":
                for flag, suffix in (("--dump-sass", ".sass"), ("--dump-resource-usage", ".res")):
                    dump = subprocess.run(
                        ["cuobjdump", flag, str(path)], capture_output=True, text=True
                    )
                    text_path = path.with_suffix(suffix)
                    text_path.write_text(dump.stdout + dump.stderr)
                    tar.add(text_path, arcname=f"{path.parent.name[:8]}/{text_path.name}")
    return archive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument(
        "--schedule", action="store_true", help="decode cases run the persistent schedule"
    )
    parser.add_argument("--out", help="folder for artifacts.tgz (needs TRITON_CACHE_DIR)")
    parser.add_argument(
        "--config", help="LogitsConfig fields in order, comma-separated ints or 'none'"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    config = None
    if args.config:
        fields = [None if f == "none" else int(f) for f in args.config.split(",")]
        config = LogitsConfig(*fields)  # type: ignore[arg-type]
    for name in args.case or sorted(CASES):
        run_case(name, device, config, args.schedule)
    if args.out:
        cache = os.environ.get("TRITON_CACHE_DIR")
        if not cache:
            raise SystemExit("--out needs TRITON_CACHE_DIR set to a fresh folder")
        print(f"wrote {collect_artifacts(Path(cache), Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
