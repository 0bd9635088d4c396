"""``python -m gpemu.cli``: the ``gpemu`` command without relying on the script on PATH."""

import sys

from gpemu.cli import main

sys.exit(main())
