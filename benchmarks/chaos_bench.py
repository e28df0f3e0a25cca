"""Chaos soak: a job on a pool of three providers whose lease holder is killed every N s.

Real ``cumulus-node`` processes on loopback (``cumulus_p2p.testing.churn``): a bootstrap
node, three CPU providers (prices 0.4, 0.5, 0.6) and a consumer training the demo model
with checkpoints, paced to last ``--job-seconds`` at least
(``cumulus_p2p.testing.paced_train``) so that every kill lands mid-job however fast the
machine is. Every ``--every`` seconds the provider holding the lease is SIGKILLed and
restarted ``--restart-after`` seconds later on the same data directory, as a rebooted
rig would be, until ``--kills`` kills. Then the job runs to its end.

Prints JSON: ``kills`` done, ``job_completed`` (1 or 0), ``loss_matches_local`` (1 or 0:
the final loss equals a local CPU run's), and ``max_failover_s``: the longest time from a
kill to the session running on a new lease (it includes the resume timeout, after which
a silent host counts as gone, and any wait for a usable host; the consumer's state,
which this polls, is rewritten every second, so each figure may be up to a second
late); ``max_resume_s``, from a kill to the job's next step after the failover; and
``job_ran_s``, the job's time on the mesh against its paced ``job_s``. Progress goes to
stderr: each kill, restart and failover, and the job's step. ``--keep DIR`` keeps the
nodes' data directories (``node.log``, ``state.json``) and the consumer's output.

Usage: python benchmarks/chaos_bench.py [--quick] [--kills 6] [--every 45]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from cumulus_p2p.testing.churn import open_provider_pool, running_on_lease
from cumulus_p2p.testing.nodes import NodeProcess, final_json, local_final_loss

PRICES = {"a": "0.4", "b": "0.5", "c": "0.6"}
#: How long the job may wait for a usable host after a failure (``--wait-for-host``): a
#: soak whose hosts all stay unusable should end, not wait the default half hour.
WAIT_FOR_HOST = "120s"
#: The nodes re-announce every second, as when the recorded figures were measured: a host
#: back from a reboot is leased again once it has announced since it failed.
ANNOUNCE_S = "1"
#: Seconds for the first lease, and for the job after the kills beyond its paced length
#: (a job that takes longer counts as not completed).
LEASE_S, FINISH_S = 180.0, 60.0


class Progress:
    """Timestamped lines on stderr, and the last step the job printed."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str, consumer: NodeProcess | None = None) -> None:
        step = f" [{last_step(consumer)}]" if consumer is not None else ""
        print(f"{time.monotonic() - self.started:7.1f}s {message}{step}", file=sys.stderr)


def last_step(consumer: NodeProcess) -> str:
    """The job's last ``step N loss L`` line, shortened to ``step N``."""
    step = step_of(consumer)
    return f"step {step}" if step else "no step yet"


def step_of(consumer: NodeProcess) -> int:
    """The last step the job printed (0 before the first)."""
    line = next((x for x in reversed(consumer.lines) if x.startswith("step ")), "step 0")
    return int(line.split()[1])


def soak(
    root: Path,
    *,
    steps: int,
    job_s: float,
    kills: int,
    every: float,
    restart_after: float,
    checkpoint_interval: str,
    resume_timeout: str,
) -> dict:
    say = Progress()
    script = ["-m", "cumulus_p2p.testing.paced_train", "--steps", str(steps)]
    script += ["--seconds", str(job_s), "--log-every", "1"]
    failovers_s: list[float] = []
    resumes_s: list[float] = []
    ran_from = 0.0
    say(f"starting a bootstrap node and providers {', '.join(PRICES)}")
    with open_provider_pool(root, PRICES, announce_interval=ANNOUNCE_S) as pool:
        say("providers up; starting the consumer")
        flags = ["--checkpoint-interval", checkpoint_interval, "--wait-for-host", WAIT_FOR_HOST]
        consumer = pool.start_consumer(
            *flags, command=script, env={"CUMULUS_RESUME_TIMEOUT": resume_timeout}
        )
        if wait_until(consumer, lambda s: running_on_lease(s, 1), LEASE_S) is None:
            say("the job never ran on a lease", consumer)
        else:
            ran_from = time.monotonic()
            say(f"running on {pool.holder(consumer.state())}", consumer)
            churn(pool, consumer, say, (failovers_s, resumes_s), kills, every, restart_after)
        deadline = time.monotonic() + job_s + FINISH_S
        while consumer.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if int(time.monotonic() - say.started) % 10 == 0 and consumer.proc.poll() is None:
                say("the job runs", consumer)
                time.sleep(1)
        completed = consumer.proc.poll() == 0
        ran_s = time.monotonic() - ran_from if ran_from else None
        say(f"the job ended ({consumer.proc.poll()})", consumer)
        final_failovers = consumer.state().get("failovers")
    (root / "consumer.out").write_text(consumer.output())
    # After the soak, not alongside it: two processes of torch threads on two cores slowed
    # the job through the mesh tenfold.
    matches = completed and final_json(consumer.lines)["final_loss"] == local_final_loss(
        ["-m", "cumulus_p2p.demo_train", "--steps", str(steps), "--log-every", "5"]
    )
    say(f"local run compared: the losses {'match' if matches else 'differ'}")
    return {
        "kills": len(failovers_s),
        "job_completed": int(completed),
        "loss_matches_local": int(matches),
        "max_failover_s": round(max(failovers_s), 2) if failovers_s else None,
        "failover_s": [round(s, 2) for s in failovers_s],
        "max_resume_s": round(max(resumes_s), 2) if resumes_s else None,
        "resume_s": [round(s, 2) for s in resumes_s],
        "steps": steps,
        "job_s": job_s,
        "job_ran_s": round(ran_s, 1) if ran_s else None,
        "every_s": every,
        "restart_after_s": restart_after,
        "resume_timeout_s": float(resume_timeout),
        "final_failovers": final_failovers,
        "seconds": round(time.monotonic() - say.started, 1),
    }


def churn(pool, consumer, say, figures, kills, every, restart_after) -> None:
    """Kill the lease holder every ``every`` s, each once the job has stepped on after the
    last failover, and restart it ``restart_after`` s after; stop at ``kills`` failovers
    or when the job ends. ``figures``: lists to append each failover's seconds to, from
    the kill to the new lease running, and to the job's next step after that."""
    failovers_s, resumes_s = figures
    restarts: dict[str, float] = {}  # name -> when to restart it
    next_kill, killed_at, lease, resumed_after = time.monotonic() + every, None, 1, None
    while consumer.proc.poll() is None and (
        len(failovers_s) < kills or restarts or killed_at is not None
    ):
        now = time.monotonic()
        for name, when in list(restarts.items()):
            if now >= when:
                pool.restart(name)
                del restarts[name]
                say(f"restarted {name}", consumer)
        if resumed_after is not None and step_of(consumer) > resumed_after:
            resumes_s.append(now - killed_at)
            say(f"the job stepped on {now - killed_at:.2f} s after kill", consumer)
            killed_at, resumed_after = None, None
        state = consumer.state()
        if killed_at is not None and resumed_after is None and running_on_lease(state, lease):
            failovers_s.append(now - killed_at)
            on = pool.holder(state)
            say(f"failover {len(failovers_s)}: {now - killed_at:.2f} s, now on {on}", consumer)
            resumed_after, next_kill = step_of(consumer), max(next_kill, now)
        elif killed_at is None and len(failovers_s) < kills and now >= next_kill:
            if running_on_lease(state, lease):  # read afresh: a probe may have moved the job
                lease = len(state["leases"]) + 1
                name = pool.holder(state)
                pool.kill(name)
                killed_at, next_kill = time.monotonic(), time.monotonic() + every
                restarts[name] = killed_at + restart_after
                say(f"kill {len(failovers_s) + 1}: SIGKILLed {name}, lease {lease - 1}", consumer)
        time.sleep(0.1)


def wait_until(consumer: NodeProcess, check, timeout: float) -> dict | None:
    """``consumer``'s state once ``check`` holds; ``None`` if it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while consumer.proc.poll() is None and time.monotonic() < deadline:
        state = consumer.state()
        if state and check(state):
            return state
        time.sleep(0.2)
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 kills 8 s apart, restarts after 2 s, a 1 s resume timeout, 100 steps in 32 s",
    )
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--every", type=float, default=45.0, help="seconds between kills")
    parser.add_argument("--restart-after", type=float, default=10.0)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument(
        "--job-seconds",
        type=float,
        help="the job's shortest run, paced (default: (kills + 1) * every)",
    )
    parser.add_argument("--checkpoint-interval", default="5s")
    parser.add_argument(
        "--resume-timeout",
        default="10",
        help="seconds a silent host is retried before it counts as gone",
    )
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the nodes' data directories (and output) in DIR"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.kills, args.every, args.restart_after = 3, 8.0, 2.0
        args.steps, args.checkpoint_interval, args.resume_timeout = 100, "1s", "1"
    job_s = args.job_seconds or (args.kills + 1) * args.every
    # ``timeout`` and Ctrl-C end the soak through its cleanup: no node is left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        root = Path(args.keep or tmp)
        result = soak(
            root,
            steps=args.steps,
            job_s=job_s,
            kills=args.kills,
            every=args.every,
            restart_after=args.restart_after,
            checkpoint_interval=args.checkpoint_interval,
            resume_timeout=args.resume_timeout,
        )
    result["quick"] = args.quick
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
