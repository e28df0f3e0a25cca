"""``cumulus-node``: run a node (provide, consume, or just route), or read what one knows.

    cumulus-node --provide [--price 0.5] [--shares 4] [--bootstrap ADDR] ...
    cumulus-node --consume [--min-vram 8GiB] [--max-price 1.0] ... -- python train.py
    cumulus-node [--listen ADDR]                 a bootstrap node: routes and relays only
    cumulus-node status | peers | offers | reputation | ledger [--data-dir DIR] [--json]
    cumulus-node logs [-n 50] [--follow]         the node's log file
    cumulus-node explore                         the web explorer of what the node knows

Every node prints ``listening on <multiaddr>`` once it has joined; other nodes pass that
address to ``--bootstrap``. Flag defaults can also come from ``config.json`` in the data
directory (keys are the flags' long names with dashes as underscores).

Exit status: the script's own with ``--consume``; 2 for a bad command line; 3 when the
node cannot start as configured; 4 when no offer matched in time.

The parts: ``_parser`` builds the command line (the node's flags by role, the commands
beside it) and checks it; ``_flags`` holds the argument types and the flags several
commands share; ``_views`` reads a data directory (``status`` ... ``ledger``, ``logs``);
``_explore`` serves the explorer; ``_run`` runs the node; ``_exits`` holds the exit
statuses and lifts our error out of trio's exception groups. The public names are
``main`` (the console script), ``build_parser``, the ``parse_price`` and
``parse_duration`` argument types (the test nodes in ``cumulus_p2p.testing`` take them
too) and the ``EXIT_*`` statuses.
"""

from __future__ import annotations

import sys

from rich.console import Console

from .._errors import CumulusError, NodeConfigError, NoMatchError
from ._exits import EXIT_CONFIG as EXIT_CONFIG
from ._exits import EXIT_NO_MATCH as EXIT_NO_MATCH
from ._exits import EXIT_USAGE as EXIT_USAGE
from ._flags import parse_duration as parse_duration
from ._flags import parse_price as parse_price
from ._parser import build_parser as build_parser
from ._parser import parse_command_line


def main(argv: list[str] | None = None) -> int:
    """Run ``cumulus-node`` with ``argv`` (default: the process's); returns its exit status."""
    console = Console()
    try:
        args, script = parse_command_line(list(sys.argv[1:] if argv is None else argv))
        if args.command is None:
            # Loaded only to run a node: a bad flag, --help and the views answer without
            # loading libp2p and the node (0.5 s of CPU).
            from ._run import run_node

            return run_node(args, script, console)
        return args.run(args, console)
    except NodeConfigError as exc:
        console.print(f"[red]cumulus-node:[/red] {exc}", highlight=False)
        return EXIT_CONFIG
    except NoMatchError as exc:
        console.print(f"[red]cumulus-node: no match:[/red] {exc}", highlight=False)
        return EXIT_NO_MATCH
    except CumulusError as exc:
        console.print(f"[red]cumulus-node:[/red] {exc}", highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130
