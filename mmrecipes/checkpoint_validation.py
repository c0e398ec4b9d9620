"""What a checkpoint directory may hold, and proof that it holds what was saved: checked before a
resume (or --init_from_checkpoint) loads anything (docs/long_runs.md).

- `link_problems`: no symbolic link inside the folder;
- `check_manifest`: every file the save wrote is there with its size and SHA-256, and nothing else;
- `check_plain_data`: every file an engine would unpickle builds nothing but tensors and plain data
  (torch's weights-only loader with our allowlist for torch zips and DCP's items at their offsets, a
  restricted unpickler to the last byte for everything else), whatever its name or protocol: a
  checkpoint someone else prepared, with a fitting manifest, runs no code.
"""

import hashlib
import io
import os
import pickle
import re
import sys
from pathlib import Path, PosixPath

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from accelerate.utils.other import TORCH_SAFE_GLOBALS
from torch.distributed.checkpoint.filesystem import _StorageInfo

ZIP_MAGIC = b"PK\x03\x04"
PLAIN_SUFFIXES = (".json", ".safetensors")
# DeepSpeed writes them beside its files
NEVER_LOADED = {"zero_to_fp32.py", "zero_to_torch.py", "latest"}
# What the pickles of a checkpoint may build beyond torch's weights-only allowlist: accelerate's RNG
# states (numpy arrays) and torch.distributed.checkpoint's metadata (plain dataclasses, the file
# names of its shards, the checkpoint's path, layouts by name).
PLAIN_DATA = [*TORCH_SAFE_GLOBALS, _StorageInfo, PosixPath, torch.serialization._get_layout,
              *(value for value in vars(dcp_metadata).values()
                if isinstance(value, type) and value.__module__ == dcp_metadata.__name__)]


class _PlainDataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals, for pickles that are not torch.save zips."""

    def __init__(self, file, allowed: list):
        super().__init__(file)
        self.allowed = {(value.__module__, value.__qualname__): value for value in allowed}

    def find_class(self, module, name):
        found = getattr(torch, name, None) if module == "torch" else None
        if isinstance(found, torch.dtype) or found is torch.Size:
            return found
        if (module, name) in self.allowed:
            return self.allowed[module, name]
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a persistent id (torch's legacy format, which we never write)")


def deepspeed_plain_data() -> list:
    """The plain-data classes in DeepSpeed's checkpoint files (an enum, a named tuple, the loss
    scale's attributes), when a DeepSpeed engine runs (it imported deepspeed; others need not pay
    the import)."""
    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that a resume must not load."""


def check_plain_data(checkpoint: Path):
    """Raise UnsafeCheckpoint if loading `checkpoint` could build anything but tensors and plain
    data."""
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file() and (problem := plain_data_problem(checkpoint, str(path.relative_to(checkpoint)))):
            raise UnsafeCheckpoint(problem)


def plain_data_problem(checkpoint: Path, name: str) -> str | None:
    """Why loading the checkpoint's file `name` could build more than tensors and plain data, or
    None."""
    path = checkpoint / name
    if path.suffix in PLAIN_SUFFIXES or path.suffix == ".distcp" or name in NEVER_LOADED:
        return None  # .distcp: checked item by item through its folder's .metadata
    allowed = PLAIN_DATA + deepspeed_plain_data()
    try:
        if path.name == ".metadata":
            with open(path, "rb") as file:
                _check_dcp_folder(path, _unpickle_all(file, allowed)[0], allowed)
        else:
            with open(path, "rb") as file:
                _check_loadable(file, allowed)
    except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError, IndexError, TypeError, OSError) as error:
        named = re.search(r"GLOBAL ([\w.]+)", str(error))  # what unpickling would have called
        what = f"unpickling it would call {named[1]}" if named else f"it is not a file these recipes write ({error})"
        return (f"{path}: {what}, which is not tensors or plain data. A resume builds nothing else: resume from a "
                "checkpoint these recipes wrote.")
    return None


def _check_loadable(file, allowed: list):
    """What torch.load would read from `file`: a zip through the weights-only loader (its tensors
    mapped, not read), else pickles to the last byte."""
    if file.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
        with torch.serialization.safe_globals(allowed):
            if isinstance(file, io.BytesIO):
                torch.load(io.BytesIO(file.getvalue()), map_location="cpu", weights_only=True)
            else:
                torch.load(file.name, map_location="cpu", weights_only=True, mmap=True)
    else:
        file.seek(0)
        _unpickle_all(file, allowed)


def _unpickle_all(file, allowed: list) -> list:
    """Every pickle in `file`, read with the restricted unpickler; refuses bytes left over."""
    size, values = file.seek(0, io.SEEK_END), []
    file.seek(0)
    while file.tell() < size or not values:
        values.append(_PlainDataUnpickler(file, allowed).load())
    return values


def _check_dcp_folder(metadata_path: Path, metadata, allowed: list):
    """The non-tensor items torch.distributed.checkpoint would load with a full unpickler."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise ValueError(f"a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata")
    byte_items = {name for name, item in metadata.state_dict_metadata.items()
                  if isinstance(item, dcp_metadata.BytesStorageMetadata)}
    for index, storage in metadata.storage_data.items():
        if Path(storage.relative_path).name != storage.relative_path or storage.relative_path in ("", ".", ".."):
            raise ValueError(f"shard path {storage.relative_path!r} leaves the folder")
        if index.fqn not in byte_items:
            continue  # tensors: torch.distributed.checkpoint loads them weights-only itself
        if storage.transform_descriptors:
            raise ValueError(f"item {index.fqn} is stored with transforms {storage.transform_descriptors}")
        with open(metadata_path.parent / storage.relative_path, "rb") as shard:
            shard.seek(storage.offset)
            _check_loadable(io.BytesIO(shard.read(storage.length)), allowed)


MANIFEST_CHUNK = 8 << 20


def file_digest(path: Path) -> list:
    """[size in bytes, SHA-256 hex] of a file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(MANIFEST_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return [size, digest.hexdigest()]


def link_problems(checkpoint: Path) -> list[str]:
    """The symbolic links inside a checkpoint folder, each a problem: a save writes none, and a link
    can lead a load to files the manifest and the pickle check never saw (a shard folder linked to a
    prepared `.metadata`). The folder itself may be a link (a checkpoint moved to other storage and
    linked back)."""
    problems = []
    for folder, names, files in os.walk(checkpoint):  # links to folders are listed, not followed
        for name in sorted(names + files):
            if (path := Path(folder) / name).is_symlink():
                problems.append(f"{path.relative_to(checkpoint)} is a symbolic link (to {os.readlink(path)}): a "
                                "checkpoint these recipes write holds none, and a load would read what it points to")
    return problems


def checkpoint_files(checkpoint: Path, marker: str) -> list[str]:
    """The files of a checkpoint, relative and sorted, less its completeness marker."""
    return sorted(str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*")
                  if path.is_file() and path.name != marker)


def check_manifest(checkpoint: Path, manifest: dict, files: list[str]) -> list[str]:
    """Problems with `files` (a share of the checkpoint's) against the saved manifest {file: [size,
    sha256]}."""
    problems = []
    for name in files:
        if name not in manifest:
            problems.append(f"{name} is not a file the save wrote")
        elif not (checkpoint / name).is_file():
            problems.append(f"{name} is missing")
        else:
            size, sha256 = file_digest(checkpoint / name)
            if size != manifest[name][0]:
                problems.append(f"{name} has {size} bytes, the save wrote {manifest[name][0]} (truncated?)")
            elif sha256 != manifest[name][1]:
                problems.append(f"{name} differs from what the save wrote (SHA-256)")
    return problems
