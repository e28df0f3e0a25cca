"""The demo's training script, held after one step until a file exists.

A test that must act on a running job (kill its worker, say) lets it run to step
``hold_at``, acts, then creates ``gate``: the job cannot finish before the test acted,
however fast or slow the machine. Usage: ``python gated_train.py steps hold_at gate``.
"""

import sys
import time
from pathlib import Path

from cumulus_p2p.demo_train import train

steps, hold_at, gate = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])


def hold(step: int) -> None:
    if step == hold_at:
        print(f"holding at step {step}", flush=True)
        while not gate.exists():
            time.sleep(0.05)


train(steps, log_every=5, after_step=hold)
