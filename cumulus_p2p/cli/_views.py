"""``cumulus-node status | peers | offers | reputation | ledger | logs``: what the node on a
data directory knows, read from its files; a running node is neither asked nor changed."""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console

from .._errors import NodeConfigError
from ..explorer import model
from ..node import logs, views
from ..node.datadir import DataDir
from ._flags import add_data_dir, data_dir

DATA_DIR_HELP = "the node's data directory (default $CUMULUS_DATA_DIR or ~/.cumulus)"
#: Each view of ``state.json``: what it shows of the state, and the table it draws.
STATE_VIEWS = {
    "status": (lambda state: state, views.status_table),
    "peers": (model.peers, views.peers_table),
    "offers": (model.offers, views.market_tables),
    "reputation": (lambda state: state.get("scores", []), views.scores_table),
}
ABOUT = {
    "status": "the node's summary and its leases",
    "peers": "the peers it is connected to",
    "offers": "prices per GPU model, and the live offers with each host's score",
    "reputation": "every host's reliability score and the evidence behind it",
    "ledger": "the receipts and the disputed ones",
}


def add_commands(commands) -> None:
    """The views, and ``logs``, as commands of ``cumulus-node``."""
    for name, about in ABOUT.items():
        view = commands.add_parser(name, help=about, description=f"Show {about}.")
        add_data_dir(view, default=argparse.SUPPRESS, help=DATA_DIR_HELP)
        view.add_argument("--json", action="store_true", help="print JSON instead of a table")
        view.set_defaults(run=show_view)
    about = "the node's log file: its last lines, and new ones as they come with --follow"
    log = commands.add_parser("logs", help=about, description=f"Show {about}.")
    add_data_dir(log, default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    log.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    log.add_argument("-n", "--lines", type=int, default=50, help="how many last lines (50)")
    log.set_defaults(run=show_logs)


def show_view(args, console: Console) -> int:
    """``cumulus-node status|peers|offers|reputation|ledger [--json]``."""
    data = data_dir(args)
    if args.command == "ledger":
        return _show_ledger(data, args.json, console)
    select, render = STATE_VIEWS[args.command]
    shown = select(_read_state(data, args.json, console))
    if args.json:  # the explorer's API serves the same (explorer/model.py)
        print(json.dumps(shown, indent=1))
    else:
        console.print(render(shown))
    return 0


def _read_state(data: DataDir, as_json: bool, console: Console) -> dict:
    state = data.read_state()
    if state is None:
        raise NodeConfigError(
            f"no node has run on {data.path} yet: start one with cumulus-node --provide, "
            "--consume or plain cumulus-node"
        )
    if not data.is_locked():  # on stderr with --json: stdout stays one JSON document
        (Console(stderr=True) if as_json else console).print(
            f"[yellow]the node on {data.path} is not running; this is what it "
            "knew when it stopped[/yellow]",
            highlight=False,
        )
    return state


def _show_ledger(data: DataDir, as_json: bool, console: Console) -> int:
    ledger = data.ledger()
    entries = list(ledger.entries())
    if as_json:
        print(json.dumps([model.entry_json(e) for e in entries], indent=1))
        return 0
    console.print(views.ledger_table(entries))
    disputes = list(ledger.disputes())
    if disputes:
        console.print(views.disputes_table(disputes))
    return 0


def show_logs(args, console: Console) -> int:
    """``cumulus-node logs [-n LINES] [--follow]``: the log file as it is."""
    data = data_dir(args)
    path = data.path / logs.LOG_FILE
    if not path.exists() and not args.follow:
        raise NodeConfigError(f"no log at {path} yet: a node started on {data.path} writes one")
    lines, end = logs.tail(path, max(0, args.lines))
    sys.stdout.writelines(lines)
    sys.stdout.flush()
    if args.follow:
        try:
            for line in logs.follow(path, start=end if path.exists() else None):
                sys.stdout.write(line)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
    return 0
