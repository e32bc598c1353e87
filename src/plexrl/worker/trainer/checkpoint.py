"""Atomic on-disk checkpoints of a job's trainer: weights, optimizer state and a manifest.

A checkpoint is a directory. It is written under a temporary name next to its final path, each
file fsynced, ``manifest.json`` last (a directory without one is incomplete), then renamed into
place; an existing checkpoint at the path is renamed away first and removed only after the new one
is in. Readers see either the old checkpoint or the new one, never a mix.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from plexrl.errors import CallFailedError, CheckpointPathError, InvalidRequestError

FORMAT = 1
TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"


class Checkpoint(NamedTuple):
    tensors: dict[str, Tensor]  # trainer weights, on CPU
    optimizer_state: dict[str, Any]  # torch optimizer state_dict
    manifest: dict[str, Any]  # format, kind, weight_version, step, spec, files


def confined(root: Path, tenant: str, path: str) -> str:
    """``path`` (relative) inside ``root/tenant``, the job's tenant's folder; raises
    ``CheckpointPathError`` for an absolute path, one that climbs out ('..', a symlink), or an
    empty one. Another tenant's folder cannot be named, so its checkpoints cannot be loaded."""
    if not TENANT.match(tenant):
        raise CheckpointPathError(f"no checkpoint folder for tenant {tenant!r}")
    if not path or os.path.isabs(path) or ".." in Path(path).parts:
        raise CheckpointPathError(
            f"checkpoint path {path!r} must be relative to your checkpoint folder on the worker, without '..' "
            "(e.g. 'runs/step-100'); absolute paths are refused"
        )
    home = (root / tenant).resolve()
    target = (home / path).resolve()
    if target == home or home not in target.parents:
        raise CheckpointPathError(f"checkpoint path {path!r} leads outside your checkpoint folder")
    home.mkdir(parents=True, exist_ok=True)
    return str(target)


def write(path: str, tensors: dict[str, Tensor], optimizer_state: dict[str, Any], manifest: dict[str, Any]) -> None:
    """Write a checkpoint at ``path`` atomically, replacing a previous checkpoint there."""

    def fill(tmp: Path) -> dict[str, Any]:
        save_file(tensors, str(tmp / WEIGHTS))
        torch.save(optimizer_state, tmp / OPTIMIZER)
        return manifest

    write_dir(path, fill)


def write_dir(path: str, fill: Callable[[Path], dict[str, Any]]) -> None:
    """Make the directory ``path`` atomically: ``fill`` writes its files into a temporary directory
    and returns the manifest; each file is fsynced, the manifest (with every file's size) written
    last, then the directory is renamed into place. What it replaces must be plexrl's too (a
    checkpoint or an export)."""
    final = Path(path)
    if final.exists() and not (final / MANIFEST).is_file():
        raise InvalidRequestError(
            f"{path!r} exists and is not a plexrl checkpoint; choose a new path or remove it first"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        manifest = fill(tmp)
        files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
        for name in files:
            _sync_file(tmp / name)
        text = json.dumps({**manifest, "format": FORMAT, "files": files}, indent=1)
        _write_synced(tmp / MANIFEST, lambda f: f.write_text(text))
        _sync_dir(tmp)
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read(path: str) -> Checkpoint:
    """Read and check a whole checkpoint into memory; ``CallFailedError`` saying what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise CallFailedError(f"no checkpoint at {path!r}: the directory does not exist; check the path")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError as e:
        raise CallFailedError(f"{path!r} has no {MANIFEST}: not a plexrl checkpoint, or an incomplete one") from e
    except (OSError, ValueError) as e:
        raise CallFailedError(f"{path!r}: {MANIFEST} is unreadable or not JSON ({e}); the checkpoint is corrupt") from e
    if isinstance(manifest, dict) and manifest.get("export"):
        raise CallFailedError(
            f"{path!r} is a {manifest['export']} export for other tools, not a checkpoint: load one written by save()"
        )
    _check_manifest(path, manifest)
    for name, size in manifest["files"].items():
        f = root / name
        if not f.is_file() or f.stat().st_size != size:
            raise CallFailedError(f"{path!r}: {name} is missing or has the wrong size; the checkpoint is corrupt")
    try:
        tensors = load_file(str(root / WEIGHTS), device="cpu")
        optimizer_state = torch.load(root / OPTIMIZER, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch.load raise several unrelated types on bad bytes
        raise CallFailedError(f"{path!r}: cannot read the checkpoint's files ({e}); it is corrupt") from e
    return Checkpoint(tensors=tensors, optimizer_state=optimizer_state, manifest=manifest)


def _check_manifest(path: str, manifest: Any) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CallFailedError(f"{path!r}: {MANIFEST} is not a format-{FORMAT} plexrl manifest")
    for key in ("weight_version", "step"):
        if not isinstance(manifest.get(key), int) or manifest[key] < 0:
            raise CallFailedError(f"{path!r}: {MANIFEST} needs a non-negative integer {key!r}")
    if not isinstance(manifest.get("kind"), str):
        raise CallFailedError(f"{path!r}: {MANIFEST} needs a 'kind' ('lora' or 'full')")
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {WEIGHTS, OPTIMIZER}:
        raise CallFailedError(f"{path!r}: {MANIFEST} must list {WEIGHTS} and {OPTIMIZER} under 'files'")


def _write_synced(f: Path, write: Callable[[Path], object]) -> None:
    write(f)
    _sync_file(f)


def _sync_file(f: Path) -> None:
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_dir(d: Path) -> None:
    # Directory fsync makes the renames durable; some filesystems refuse it, which is harmless here.
    try:
        _sync_file(d)
    except OSError:
        return


def _move_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        old = final.with_name(f"{final.name}.old-{secrets.token_hex(4)}")
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
        _sync_dir(final.parent)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
        _sync_dir(final.parent)
