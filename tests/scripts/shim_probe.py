"""Reports what a script sees under the shim, then ends as its arguments say.

``shim_probe.py [exit N | raise | wait] ...``: prints one JSON line, then exits with status
N, raises ``ValueError`` or waits for a line on stdin; otherwise returns.
"""

import json
import sys

import torch

cuda = torch.cuda.is_available()
x = torch.ones(3).cuda() if cuda else torch.ones(3, device="cumulus")
report = {
    "argv": sys.argv,
    "name": __name__,
    "cuda": cuda,
    "device": str(x.device),
    "sum": x.sum().item(),
    "path0": sys.path[0],
}
print(json.dumps(report), flush=True)
if sys.argv[1:2] == ["exit"]:
    sys.exit(int(sys.argv[2]))
if sys.argv[1:2] == ["raise"]:
    raise ValueError("boom from the script")
if sys.argv[1:2] == ["wait"]:
    sys.stdin.readline()  # until the test ends it
