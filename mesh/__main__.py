"""``python -m mesh``: the ``agentmesh`` command, for an environment whose scripts are not on
the PATH."""

import sys

from mesh.cli import main

sys.exit(main())
