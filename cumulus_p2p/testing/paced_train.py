"""The demo's training script, paced: step ``s`` ends no earlier than ``s * seconds / steps``.

A benchmark that acts on a running job on a clock (kills its host every few seconds)
needs the job to outlast its schedule however fast the machine is, and to keep sending
ops throughout, so that each kill lands mid-work. Pacing does both, and leaves the
result that of ``python -m cumulus_p2p.demo_train --steps STEPS`` (sleeping between
steps changes no number). A job slowed down by a failover catches up unpaced.

    python -m cumulus_p2p.testing.paced_train --steps 150 --seconds 30 [--log-every 5]
"""

from __future__ import annotations

import argparse
import time

from cumulus_p2p.demo_train import train


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True, help="the job's shortest run")
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args(argv)
    per_step = args.seconds / args.steps
    started = time.monotonic()

    def pace(step: int) -> None:
        time.sleep(max(0.0, started + step * per_step - time.monotonic()))

    train(args.steps, args.log_every, after_step=pace)


if __name__ == "__main__":
    main()
