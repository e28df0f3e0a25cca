"""The job spam_bench.py's consumers run once leased: it prints when it started."""

import json
import time

print(json.dumps({"job_started": time.time()}), flush=True)
