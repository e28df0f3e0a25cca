"""FSDP2 (``fully_shard``) frees and re-allocates the storage of cumulus tensors.

Between uses, FSDP2 frees a layer's gathered parameters by resizing their storage to
nothing (``free_storage``: ``tensor.untyped_storage().resize_(0)``) and gives it memory
again before the next all-gather (``alloc_storage``: ``resize_(numel * itemsize)``), so a
model's full parameters are never all in memory at once. A cumulus tensor is a wrapper
subclass whose storage holds no data of its own, and torch refuses ``resize_`` on such a
storage ("invalid python storage") before any device hook is asked: PrivateUse1 has no
say in it. So ``adapt`` replaces those two functions, in the FSDP2 modules that call them,
with ones that resize a cumulus tensor's storage on the executor
(``RemoteStorage.resize``: the memory is really freed there, and allocated again) and
leave every other tensor to torch's own. Nothing else of torch changes.

``adapt`` runs when a ``cumulus`` process group is created (``distributed.py``): FSDP2
shards over a process group, and importing FSDP2 costs about 80 ms that a session
without one need not pay.

Checked with torch 2.13, where FSDP2 defines both functions in ``_fsdp_param`` and
``_fsdp_param_group`` imports ``alloc_storage`` by name. Not yet run on torch 2.11 (the
GPU hosts'); it uses nothing newer than FSDP2's package and these two names, and every
module of ``torch.distributed.fsdp._fully_shard`` that holds either name gets the
replacement, wherever a version defines them (``_fsdp_common``, say). A torch whose FSDP2
frees storage some other way leaves cumulus tensors to torch's own refusal.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from .tensor import RemoteTensor

_PACKAGE = "torch.distributed.fsdp._fully_shard"


def adapt() -> None:
    """Make FSDP2's ``free_storage``/``alloc_storage`` resize cumulus tensors' storages on
    the executor (idempotent)."""
    __import__(_PACKAGE)
    prefix = _PACKAGE + "."
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix):
            continue
        for attribute, wrap in (("free_storage", _freeing), ("alloc_storage", _allocating)):
            original = getattr(module, attribute, None)
            if callable(original) and not hasattr(original, "__wrapped__"):
                setattr(module, attribute, wrap(original))


def _freeing(free_storage: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    @functools.wraps(free_storage)
    def free(tensor: torch.Tensor) -> None:
        if type(tensor) is not RemoteTensor:
            free_storage(tensor)
        elif tensor._rs.nbytes != 0:
            tensor._rs.resize(tensor, 0)

    return free


def _allocating(alloc_storage: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    @functools.wraps(alloc_storage)
    def alloc(tensor: torch.Tensor) -> None:
        if type(tensor) is not RemoteTensor:
            alloc_storage(tensor)
            return
        nbytes = tensor.numel() * tensor.itemsize
        if tensor._rs.nbytes != nbytes:
            tensor._rs.resize(tensor, nbytes)

    return alloc
