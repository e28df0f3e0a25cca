"""The demo's training script, held after each of several steps until a file exists.

A test that acts on a running job again and again (kills its host, say) lets it run to
each step in ``holds``, acts, then creates ``gates/<step>``: the job cannot pass a step
before the test acted there. Usage: ``python multi_gated_train.py steps 10,15,20 gates``.
"""

import sys
import time
from pathlib import Path

from cumulus_p2p.demo_train import train

steps, holds, gates = int(sys.argv[1]), {int(s) for s in sys.argv[2].split(",")}, Path(sys.argv[3])


def hold(step: int) -> None:
    if step in holds:
        print(f"holding at step {step}", flush=True)
        while not (gates / str(step)).exists():
            time.sleep(0.05)


train(steps, log_every=5, after_step=hold)
