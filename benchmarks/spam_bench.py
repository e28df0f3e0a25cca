"""Spam on the market (issue 36): does a flooding attacker keep a consumer from leasing?

Real nodes on loopback: a bootstrap node, an honest CPU provider (--price 0.5, 4
shares), then a consumer (--max-price 1) whose match time is measured without attack.
Then ``cumulus_p2p.testing.spammer`` joins with 50 keys and floods valid, signed junk
offers (an H100 80 GiB at 0.000001 credits, a new offer id each time, its host taking
lease proposals and never answering) for the rest of the run, and a second consumer's
match time is measured under attack.

A match time runs from the consumer process's start to its job's start (so both include
the same start-up). Printed as JSON, and saved to benchmarks/results/spam.json:

- clean_match_s, attack_match_s: the two match times; attack_leased_honest: whether the
  consumer under attack leased the honest provider;
- max_offers_per_author: the most live offers one author has in the bootstrap node's
  book during the attack (the cap is --max-offers-per-author, 8 by default), and
  junk_offers_in_book: all the attacker's offers there;
- victim_rss_growth_mib, victim_cpu_share: the bootstrap node's memory growth and its
  share of one core over the attack;
- attacker_sent, attacker_per_s: what the attacker published.

Usage: python benchmarks/spam_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

from cumulus_p2p.testing.nodes import (
    LOOPBACK_LISTEN,
    final_json,
    start_consumer,
    start_node,
    start_process,
    start_provider,
)

JOB = [str(Path(__file__).with_name("spam_job.py"))]
RESULTS = Path(__file__).with_name("results") / "spam.json"
#: The honest nodes re-announce every second, as when the recorded figures were measured.
ANNOUNCE_S = "1"


def match_time(root: Path, name: str, boot: str, timeout: float) -> tuple[float, str]:
    """Start a consumer; return the seconds until its job started, and its lease's host."""
    started = time.time()
    consumer = start_consumer(
        root / name,
        boot,
        "--max-price",
        "1",
        "--match-timeout",
        "60",
        command=JOB,
        announce_interval=ANNOUNCE_S,
    )
    try:
        assert consumer.proc.wait(timeout=timeout) == 0, consumer.output()
    finally:
        consumer.stop()
    job = final_json(consumer.lines)
    (lease, *_) = json.loads((root / name / "state.json").read_text())["leases"]
    return job["job_started"] - started, lease["host"]


def book_per_author(boot) -> Counter:
    return Counter(row["host"] for row in boot.state().get("offers", []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter flood (< 2 minutes)")
    parser.add_argument("--keys", type=int, default=50)
    args = parser.parse_args()
    flood_before_s = 10.0 if args.quick else 45.0
    nodes = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            boot = start_node(root / "boot", "--listen", LOOPBACK_LISTEN, "--no-live")
            nodes.append(boot)
            honest = start_provider(
                root / "honest",
                boot.addr,
                "--price",
                "0.5",
                "--shares",
                "4",
                announce_interval=ANNOUNCE_S,
            )
            nodes.append(honest)
            honest.wait_for("providing", timeout=120)
            honest_id = honest.wait_for_state(lambda s: s.get("peer_id"))["peer_id"]
            clean_s, clean_host = match_time(root, "clean", boot.addr, 180)

            victim = psutil.Process(boot.proc.pid)
            rss0, cpu0, t0 = victim.memory_info().rss, victim.cpu_times(), time.monotonic()
            command = [sys.executable, "-m", "cumulus_p2p.testing.spammer"]
            command += ["--bootstrap", boot.addr, "--keys", str(args.keys)]
            spammer = start_process(command, root / "spammer", listens=True)
            nodes.append(spammer)
            peak = Counter()
            deadline = time.monotonic() + flood_before_s
            while time.monotonic() < deadline:
                peak = max(peak, book_per_author(boot), key=lambda c: sum(c.values()))
                time.sleep(1.0)
            attack_s, attack_host = match_time(root, "attacked", boot.addr, 180)
            book = book_per_author(boot)
            junk = {h: n for h, n in (peak + book).items() if h != honest_id}
            cpu1, t1 = victim.cpu_times(), time.monotonic()
            rss1 = victim.memory_info().rss
            sent = [json.loads(x) for x in spammer.lines if x.startswith('{"sent"')]
        finally:
            for node in reversed(nodes):
                node.stop()
    busy = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    result = {
        "quick": args.quick,
        "keys": args.keys,
        "clean_match_s": round(clean_s, 2),
        "clean_leased_honest": clean_host == honest_id,
        "attack_match_s": round(attack_s, 2),
        "attack_leased_honest": attack_host == honest_id,
        "max_offers_per_author": max(max(peak.values(), default=0), max(book.values(), default=0)),
        "junk_offers_in_book": sum(n for h, n in book.items() if h != honest_id),
        "junk_authors_seen": len(junk),
        "victim_rss_growth_mib": round((rss1 - rss0) / 2**20, 1),
        "victim_cpu_share": round(busy / (t1 - t0), 3),
        "attack_window_s": round(t1 - t0, 1),
        "attacker_sent": sent[-1]["sent"] if sent else 0,
        "attacker_per_s": sent[-1]["per_s"] if sent else 0,
    }
    print(json.dumps(result, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
