"""``python -m ckptd`` runs the CLI (this is how a client spawns the daemon)."""

import sys

from ckptd.cli import main

sys.exit(main())
