"""A main script WITHOUT the `if __name__ == "__main__":` guard (on purpose).

Usage: python tests/support/manager_unguarded_main.py [TIMEOUT_S]
Its top level starts the Manager warm-up and waits for it, like a careless training
script. Should a spawned child re-import this file, the top level prints its marker
again and then blocks, as training code waiting for its peers would; the Manager would
then never come up and the wait would end in ManagerStartError.
"""

import os
import sys
import time

from ml_flashpoint_nemo.core.sync_manager import start_manager_warmup
from ml_flashpoint_nemo.errors import ManagerStartError

print(f"TOP LEVEL pid={os.getpid()} name={__name__}", flush=True)
if __name__ != "__main__":  # re-imported by a spawned child (as __mp_main__): "training" hangs here
    time.sleep(3600)

future = start_manager_warmup(timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
try:
    manager = future.result(what="the unguarded-main test script")
except ManagerStartError as exc:
    print(f"MANAGER ERROR {exc}", flush=True)
    sys.exit(3)
shared = manager.dict()
shared["answer"] = 42
print(f"MANAGER READY pid={future.pid} answer={shared['answer']}", flush=True)
future.close()
print("DONE", flush=True)
