"""``python -m plexrl`` is the ``plexrl`` command."""

import sys

from plexrl.cli import main

sys.exit(main())
