"""The bench's outputs: the table it prints, kernels.json, and the roofline plot.

kernels.json (`write_outputs`) holds one object: `meta` (device, versions, date), `ceilings`
(every `Ceilings` field) and `results` (every `CaseResult` field, plus `tbps`, `tflops` and
`pct_of_floor`). `read_outputs` reads it back and refuses, with a ValueError, a file that is not
one; `replot` draws the plot again from it without a GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from graphidx.bench.roofline import CaseResult, Ceilings


def format_table(results: list[CaseResult]) -> str:
    """One line per case: replay time, device span (`kernel us`, from the notes; `-` where
    not measured), floor, achieved rates and % of floor (from the replay time), check, and
    the other notes."""
    header = (
        f"{'case':<26} {'shape':<52} {'time us':>10} {'kernel us':>10} {'floor us':>9} "
        f"{'TB/s':>6} {'TFLOP/s':>8} {'% floor':>8}  check"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        kernel = r.notes.get("kernel_us")
        span = f"{kernel:>10.1f}" if isinstance(kernel, float) else f"{'-':>10}"
        rest = {key: value for key, value in r.notes.items() if key != "kernel_us"}
        if kernel is not None and not isinstance(kernel, float):
            rest["kernel_us"] = kernel  # why there is no span
        lines.append(
            f"{r.name:<26} {r.shape:<52} {r.time_us:>10.1f} {span} {r.floor_us:>9.1f} "
            f"{r.tbps:>6.2f} {r.tflops:>8.1f} {r.pct_of_floor:>7.0f}%  {r.check}"
            + (f"  {rest}" if rest else "")
        )
    return "\n".join(lines)


def plot_label(result: CaseResult) -> str:
    """The case name, with the head count when the shape starts with one (`H64 ...`)."""
    head = result.shape.split()[0].rstrip(",") if result.shape.split() else ""
    return f"{result.name} {head}" if head[:1] == "H" and head[1:].isdigit() else result.name


def plot_roofline(results: list[CaseResult], ceilings: Ceilings, path: Path) -> bool:
    """Write a two-panel PNG of the main cases (variants left out): left, achieved TFLOP/s
    against arithmetic intensity under the roofline (cases with FLOPs); right, each case's
    replay time as a multiple of its floor (top-k's floor is one read of the logits), its
    device span (`kernel_us`) a tick on the bar, with marks at 1.5x and 3x the floor. False
    when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    bandwidth = ceilings.copy_bytes_per_s
    peak = ceilings.matmul_flops_per_s
    shown = [r for r in results if not r.variant and r.time_us > 0 and r.floor_us > 0]
    fig, (roof, ratio) = plt.subplots(1, 2, figsize=(16, 6.5), width_ratios=(1, 1.1))
    intensities = [10 ** (x / 10) for x in range(-10, 41)]
    roof.plot(intensities, [min(peak, bandwidth * i) / 1e12 for i in intensities], "k-")
    markers = "osD^v<>ph*"
    for index, r in enumerate(x for x in shown if x.flops > 0 and x.bytes_moved > 0):
        label = f"{plot_label(r)}: {r.pct_of_floor:.0f}% of floor"
        marker = markers[index % len(markers)]
        roof.plot(r.flops / r.bytes_moved, r.tflops, marker, markersize=8, label=label)
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlabel("arithmetic intensity (FLOP / byte)")
    roof.set_ylabel("TFLOP/s")
    roof.set_title(f"roofline: {bandwidth / 1e12:.1f} TB/s, {peak / 1e12:.0f} TFLOP/s")
    roof.grid(True, which="both", alpha=0.3)
    roof.legend(fontsize=8, loc="lower right")
    if not shown:  # every case failed, or only sweep points were run
        ratio.text(0.5, 0.5, "no case with a time and a floor", ha="center", va="center")
        ratio.set_axis_off()
        return _save(fig, path)
    labels = [plot_label(r) for r in shown]
    multiples = [r.time_us / r.floor_us for r in shown]
    colors = ["0.6" if r.reference or r.check == "-" else "tab:blue" for r in shown]
    rows = range(len(shown))
    ratio.barh(rows, multiples, color=colors)
    for row, r, multiple in zip(rows, shown, multiples, strict=True):
        kernel = r.notes.get("kernel_us")
        text = f" {r.time_us:.1f} us ({multiple:.2f}x)"
        if isinstance(kernel, float) and kernel > 0:  # the device span: a black tick
            ratio.plot([kernel / r.floor_us] * 2, [row - 0.4, row + 0.4], "k-", linewidth=2)
            text += f", kernel {kernel:.1f} us ({kernel / r.floor_us:.2f}x)"
        if math.log(multiple) > 0.45 * math.log(1.6 * max(multiples)):  # most of the log
            # axis: the label inside the bar, at its root
            ratio.text(1.02, row, text, va="center", fontsize=8, color="white")
        else:
            ratio.text(multiple, row, text, va="center", fontsize=8)
    for mark in (1.5, 3.0):
        ratio.axvline(mark, color="tab:red", linestyle="--", linewidth=1)
    ratio.set_yticks(list(rows), labels, fontsize=8)
    ratio.invert_yaxis()
    ratio.set_xscale("log")
    ticks = [t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100) if t <= 1.3 * max(multiples)]
    ratio.set_xticks(ticks, [f"{t:g}x" for t in ticks])
    ratio.minorticks_off()
    ratio.set_xlim(1, 1.6 * max(multiples))
    ratio.set_xlabel(
        "replay time / floor (black tick: the device span; 1x: at the floor; red: 1.5x and 3x;"
        " gray: not graphidx)"
    )
    ratio.set_title("time against each case's floor")
    ratio.grid(True, axis="x", which="both", alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> bool:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_FieldType = type | tuple[type, ...]
_NUMBER = (int, float)
_REQUIRED_RESULT_FIELDS: dict[str, _FieldType] = {
    "name": str,
    "shape": str,
    "time_us": _NUMBER,
    "bytes_moved": _NUMBER,
    "flops": _NUMBER,
    "floor_us": _NUMBER,
    "check": str,
}
_OPTIONAL_RESULT_FIELDS: dict[str, _FieldType] = {"notes": dict, "variant": bool, "reference": bool}


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def _not_kernels_json(payload: object) -> str | None:
    """Why `payload` is not what `write_outputs` writes, or None when it is."""
    if not isinstance(payload, dict):
        return f"the top level is a {type(payload).__name__}, not an object"
    for key, container in (("results", list), ("ceilings", dict), ("meta", dict)):
        if not isinstance(payload.get(key), container):
            return f"no {container.__name__} {key!r}"
    for name, value in payload["ceilings"].items():
        if value is not None and not _is_number(value):
            return f"ceilings[{name!r}] = {value!r} is not a number"
    for index, row in enumerate(payload["results"]):
        if not isinstance(row, dict):
            return f"results[{index}] is not an object"
        for name, kind in {**_REQUIRED_RESULT_FIELDS, **_OPTIONAL_RESULT_FIELDS}.items():
            if name not in row:
                if name in _REQUIRED_RESULT_FIELDS:
                    return f"results[{index}] has no {name!r}"
                continue
            value = row[name]
            ok = _is_number(value) if kind == _NUMBER else isinstance(value, kind)
            if not ok:
                return f"results[{index}][{name!r}] = {value!r} has the wrong type"
    return None


def read_outputs(json_path: Path) -> tuple[list[CaseResult], Ceilings, dict[str, Any]]:
    """(results, ceilings, meta) of a `kernels.json` that `write_outputs` wrote.

    Fields another version added are left out, so files of a newer checkout read here.
    ValueError naming the file and what is wrong when it is missing, not JSON or not a
    kernels.json."""
    path = Path(json_path)
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    reason = _not_kernels_json(payload)
    if reason is not None:
        raise ValueError(f"{path} is not a kernels.json of graphidx bench: {reason}")
    result_fields = {f.name for f in fields(CaseResult)}
    results = [
        CaseResult(**{k: v for k, v in row.items() if k in result_fields})
        for row in payload["results"]
    ]
    known = {f.name for f in fields(Ceilings)}
    ceilings = Ceilings(**{k: v for k, v in payload["ceilings"].items() if k in known})
    return results, ceilings, payload["meta"]


def replot(json_path: Path, png_path: Path) -> bool:
    """Draw `plot_roofline` again from a `kernels.json` (no GPU needed)."""
    results, ceilings, _ = read_outputs(json_path)
    return plot_roofline(results, ceilings, png_path)


def write_outputs(
    results: list[CaseResult], ceilings: Ceilings, out_dir: Path, meta: dict[str, Any]
) -> list[Path]:
    """Write `out_dir`/kernels.json and, with matplotlib, `out_dir`/roofline.png; the paths
    written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "kernels.json"
    payload = {
        "meta": meta,
        "ceilings": asdict(ceilings),
        "results": [
            {**asdict(r), "tbps": r.tbps, "tflops": r.tflops, "pct_of_floor": r.pct_of_floor}
            for r in results
        ],
    }
    json_path.write_text(json.dumps(payload, indent=2, default=str))
    written = [json_path]
    png = out_dir / "roofline.png"
    if plot_roofline(results, ceilings, png):
        written.append(png)
    return written
