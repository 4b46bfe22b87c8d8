from __future__ import annotations

import sys

from chaos.cli import main

sys.exit(main())
