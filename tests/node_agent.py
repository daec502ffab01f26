"""torchrun's elastic agent for ``tests/torchrun_nodes.py``, which first says that it started.

Usage: python tests/node_agent.py READY TORCHRUN-ARGS...: creates the file READY, then runs
``torch.distributed.run`` with the rest, which connects to the rendezvous store at once.
"""

import sys
from pathlib import Path

from torch.distributed.run import main

if __name__ == "__main__":
    Path(sys.argv[1]).touch()
    main(sys.argv[2:])
