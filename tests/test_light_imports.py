"""What loads libp2p (0.5 s of a process's CPU) and what need not: the market's cores and
the command line's answers that run no node."""

from __future__ import annotations

import ast
import subprocess
import sys


def printed(code: str) -> str:
    """What a fresh interpreter printed running ``code`` (it must exit cleanly)."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return done.stdout


def loaded_libp2p(code: str) -> list[str]:
    """The libp2p modules a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if 'libp2p' in m))"
    return ast.literal_eval(printed(probe).splitlines()[-1])


def test_the_market_cores_load_no_libp2p():
    code = "import cumulus_p2p.market; from cumulus_p2p.market import OrderBook, Meter, ledger"
    assert loaded_libp2p(code) == []


def test_a_shell_name_of_the_market_package_loads_its_module_when_first_used():
    code = (
        "from cumulus_p2p.market import LeaseServer, call_probe;"
        " from cumulus_p2p.market import negotiation, probing;"
        " assert LeaseServer is negotiation.LeaseServer and call_probe is probing.call_probe"
    )
    assert loaded_libp2p(code) != []


def test_an_unknown_name_of_the_market_package_is_an_attribute_error():
    code = (
        "import cumulus_p2p.market as m\n"
        "try:\n    m.NoSuchThing\nexcept AttributeError as e:\n    print(e)\n"
        "else:\n    raise SystemExit('no error')"
    )
    assert "has no attribute 'NoSuchThing'" in printed(code)


def test_a_bad_flag_help_and_a_view_answer_without_loading_libp2p(tmp_path):
    code = (
        "from cumulus_p2p.cli import main\n"
        "for argv, status in ([['--no-such-flag'], 2], [['--help'], 0]):\n"
        "    try:\n        main(argv)\n"
        "    except SystemExit as e:\n        assert e.code == status, e.code\n"
        f"main(['status', '--data-dir', {str(tmp_path)!r}])"
    )
    assert loaded_libp2p(code) == []
