"""``cumulus-node logs``: a node's log file, its last lines, and new ones as they come."""

from __future__ import annotations

import subprocess
import threading
import time

from cumulus_p2p.node.logs import LOG_FILE, follow, last_lines, tail
from cumulus_p2p.testing.nodes import node_command


def test_the_last_lines_of_the_log_are_shown(tmp_path):
    (tmp_path / LOG_FILE).write_text("".join(f"line {i}\n" for i in range(100)))
    done = subprocess.run(
        node_command("logs", "--data-dir", str(tmp_path), "-n", "3"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["line 97", "line 98", "line 99"]


def test_logs_of_a_data_dir_where_no_node_ran_say_so(tmp_path):
    done = subprocess.run(
        node_command("logs", "--data-dir", str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    assert "no log at" in done.stdout


def test_follow_prints_lines_as_they_are_written_until_interrupted(tmp_path):
    log = tmp_path / LOG_FILE
    log.write_text("old\n")
    proc = subprocess.Popen(
        node_command("logs", "--data-dir", str(tmp_path), "--follow"),
        stdout=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(60, proc.kill)  # a missed line fails the test, not hangs it
    watchdog.start()
    try:
        assert proc.stdout.readline() == "old\n"
        with open(log, "a") as f:
            f.write("new\n")
        assert proc.stdout.readline() == "new\n"
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(timeout=10)


def test_follow_goes_on_into_the_new_file_after_a_rotation(tmp_path):
    log = tmp_path / LOG_FILE
    log.write_text("before\n")
    seen: list[str] = []
    stop = threading.Event()
    reader = threading.Thread(
        target=lambda: seen.extend(follow(log, poll_s=0.02, keep_going=lambda: not stop.is_set()))
    )
    reader.start()
    time.sleep(0.2)
    with open(log, "a") as f:
        f.write("last of the old file\n")
    log.rename(tmp_path / f"{LOG_FILE}.1")
    log.write_text("first of the new file\n")
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    reader.join(timeout=5)
    assert seen == ["last of the old file\n", "first of the new file\n"]


def test_no_more_lines_than_the_file_holds(tmp_path):
    (tmp_path / LOG_FILE).write_text("only\n")
    assert last_lines(tmp_path / LOG_FILE, 50) == ["only\n"]
    assert last_lines(tmp_path / "absent.log", 50) == []


def test_follow_goes_on_from_where_the_last_lines_ended(tmp_path):
    log = tmp_path / LOG_FILE
    log.write_text("shown\n")
    lines, end = tail(log, 50)
    with open(log, "a") as f:
        f.write("written in between\n")
    followed = follow(log, start=end, poll_s=0.01)
    assert lines == ["shown\n"]
    assert next(followed) == "written in between\n"
    followed.close()
