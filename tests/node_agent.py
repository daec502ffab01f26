"""torchrun's elastic agent for ``tests/torchrun_nodes.py``, which first says that it started.

Usage: python tests/node_agent.py READY TORCHRUN-ARGS...: creates the file READY, then runs
``torch.distributed.run`` with the rest, which connects to the rendezvous store at once. Its log says
when each rendezvous round began and ended (torchrun's INFO lines, with times).
"""

import logging
import sys
from pathlib import Path

from torch.distributed.run import main

if __name__ == "__main__":
    for name in list(logging.root.manager.loggerDict):  # set at import, from LOGLEVEL
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.INFO)
    Path(sys.argv[1]).touch()
    main(sys.argv[2:])
