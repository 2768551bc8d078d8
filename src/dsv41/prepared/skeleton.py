"""The object tree around the tensors of a built FastModel, as pickle parts whose tensors live in data.bin.

Pickling keeps the tree exactly as the builder made it (the layers' launch records, split counts, groups and
flags included), so a start from a folder runs the same code on the same objects without re-deriving anything.
Everything that belongs to one process is a reference, resolved by the loader:
- a tensor -> ("t", entry, dtype, storage offset, shape, stride): entry = one storage's bytes in data.bin, so views
  of one storage stay views of one storage;
- a torch.device -> its type (the loader's device of that type), the Comm, the PrefillWorkspace (re-made at its
  recorded size), the Tokenizer (read from the checkpoint folder), a checkpoint-backed EngramTable (reopened from
  its shard file or the checkpoint, as the builder does), a stored block ("block", L).

Loading is restricted (`SkeletonUnpickler.find_class`): classes of dsv41, torch dtypes and a few plain containers
of the standard library and numpy; anything else in a part refuses the folder instead of running it.
"""

from __future__ import annotations

import builtins
import collections
import functools
import io
import pathlib
import pickle
from dataclasses import dataclass
from typing import Callable

import torch

from dsv41.errors import DSV41Error

from .manifest import PreparedMismatch

PROTOCOL = 5


@dataclass(frozen=True)
class BlockRef:
    """Stands for block `index` in the model part: the block is its own part ("block.L")."""

    index: int


def _engram_table_type():
    from dsv41.engram.tables import EngramTable

    return EngramTable


class Storages:
    """The storages a prepare has met, each once (kept alive until the prepare ends, so an address is never
    reused by another storage while it is registered): `entry(t)` -> the entry index of t's storage."""

    def __init__(self):
        self.by_key: dict[tuple, int] = {}
        self.pending: list[dict] = []  # entries met since the last `take_pending` (the writer stores them)
        self.count = 0
        self._alive: list = []

    def entry(self, t: torch.Tensor, name: str) -> int:
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0:
            key = ("empty", self.count)
        index = self.by_key.get(key)
        if index is None:
            index = self.by_key[key] = self.count
            self.count += 1
            self._alive.append(storage)
            self.pending.append({"index": index, "name": name, "storage": storage, "device": storage.device.type,
                                 "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        return index

    def take_pending(self) -> list[dict]:
        out, self.pending = self.pending, []
        return out


def tensor_names(root, prefix: str) -> dict[int, str]:
    """id(tensor) -> the first attribute path it is found at under `root` (names for the manifest's entries)."""
    names, seen, stack = {}, set(), [(root, prefix)]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, torch.Tensor):
            names.setdefault(id(obj), path)
            continue
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            stack.extend((v, f"{path}.{k}") for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(obj))
        elif hasattr(obj, "__dict__"):
            stack.extend((v, f"{path}.{k}") for k, v in vars(obj).items())
    return names


class SkeletonPickler(pickle.Pickler):
    def __init__(self, file, storages: Storages, names: dict[int, str], part: str):
        super().__init__(file, protocol=PROTOCOL)
        from dsv41.parallel.comm import Comm
        from dsv41.runtime.layers.linear import PrefillWorkspace
        from dsv41.tokenizer import Tokenizer

        self.storages, self.names, self.part = storages, names, part
        self.kinds = (Comm, PrefillWorkspace, Tokenizer, _engram_table_type())
        self.modules: set[str] = set()
        self.workspace_numel = 0

    def persistent_id(self, obj):
        module = type(obj).__module__
        if module.startswith("dsv41."):
            self.modules.add(module)
        if isinstance(obj, torch.Tensor):
            index = self.storages.entry(obj, self.names.get(id(obj), f"{self.part}#{self.storages.count}"))
            return ("t", index, str(obj.dtype).removeprefix("torch."), obj.storage_offset(), tuple(obj.shape),
                    tuple(obj.stride()))
        if isinstance(obj, torch.device):
            return ("device", obj.type)
        if isinstance(obj, BlockRef):
            return ("block", obj.index)
        comm, workspace, tokenizer, table = self.kinds
        if isinstance(obj, comm):
            return ("comm",)
        if isinstance(obj, workspace):
            self.workspace_numel = max(self.workspace_numel, obj.numel)
            return ("workspace",)
        if isinstance(obj, tokenizer):
            return ("tokenizer",)
        if isinstance(obj, table):
            return ("engram_table", obj.layer_id)
        return None


def dump_part(obj, part: str, storages: Storages) -> tuple[bytes, SkeletonPickler]:
    """The part's pickle bytes (its new storages are left in `storages.pending`)."""
    buf = io.BytesIO()
    pickler = SkeletonPickler(buf, storages, tensor_names(obj, part), part)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise DSV41Error(f"cannot prepare {part}: an object of it cannot be stored ({exc})") from None
    return buf.getvalue(), pickler


_BUILTINS = {"set", "frozenset", "slice", "range", "complex", "bytearray", "object", "tuple", "list", "dict"}
_ALLOWED = {
    "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
    "functools": {"partial"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.core.numeric": {"_frombuffer"},  # protocol 5's form of an array
    "numpy._core.numeric": {"_frombuffer"},
    "torch": {"Size"},
}
_MODULES = {"collections": collections, "functools": functools, "pathlib": pathlib}


class SkeletonUnpickler(pickle.Unpickler):
    """Loads a part with its references resolved by `resolve(pid)`; refuses globals outside the allowed set."""

    def __init__(self, file, resolve: Callable, part: str):
        super().__init__(file)
        self.resolve, self.part = resolve, part

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if module.startswith("dsv41."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        elif module == "numpy.dtypes":
            return super().find_class(module, name)
        raise PreparedMismatch(f"skeleton part {self.part} names {module}.{name}, which a prepared folder may not "
                               f"load: run `dsv41 prepare` again")

    def persistent_load(self, pid):
        return self.resolve(pid)


def load_part(data: bytes, part: str, resolve: Callable):
    try:
        return SkeletonUnpickler(io.BytesIO(data), resolve, part).load()
    except PreparedMismatch:
        raise
    except Exception as exc:  # a class that changed shape since the folder was written, a damaged part
        raise PreparedMismatch(f"skeleton part {part} does not load ({type(exc).__name__}: {exc}): "
                               f"run `dsv41 prepare` again") from None


def tensor_view(storage: torch.UntypedStorage, dtype: str, offset: int, shape, stride) -> torch.Tensor:
    """The tensor the pickler referenced, as a view of the loaded storage."""
    t = torch.empty(0, dtype=getattr(torch, dtype), device=storage.device)
    return t.set_(storage, offset, tuple(shape), tuple(stride))
