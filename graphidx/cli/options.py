"""Checks of the options the commands share, run before any long work.

Each raises ValueError naming the option and its value; `graphidx` prints it as one line,
`graphidx <command>: error: ...`, and exits with status 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(name: str | None) -> torch.device:
    """`--device`: cpu, cuda or cuda:N (None or empty: the GPU when there is one, else the
    CPU). ValueError for a name torch does not know, another device type, or a GPU that is
    not there."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(
            f"--device {name}: the {device.type!r} device type is not supported; "
            "use cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA/ROCm GPU is available")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name}: only {count} GPU(s) are visible")
    return device


def check_output_file(option: str, path: str) -> Path:
    """A file the command will write at the end: its folder must exist and be writable, and
    the path must not be a folder."""
    file = Path(path)
    folder = file.parent
    if file.is_dir():
        raise ValueError(f"{option} {path}: is a folder, not a file")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{option} {path}: the folder {folder} is not writable")
    return file


def check_output_folder(option: str, path: str) -> Path:
    """A folder the command will create if needed and write into: not an existing file, and
    its nearest existing ancestor writable."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {path}: is a file, not a folder")
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise ValueError(f"{option} {path}: {existing} is not a writable folder")
    return folder
