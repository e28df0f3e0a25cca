"""Sends itself SIGTERM from inside an op's dispatch, then finishes that op and idles.

Under the shim the op must complete (it prints ``op done``) and the script must then end
with status 143, not abort inside torch's C++.
"""

import os
import signal
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SignalInsideTheOp(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs here, inside the dispatch
        return func(*args, **(kwargs or {}))


with SignalInsideTheOp():
    total = torch.ones(3) + 1
print("op done", flush=True)
time.sleep(30)
