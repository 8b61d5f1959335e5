"""`python -m deployments <tool>`: see `deployments.cli`."""

import sys

from deployments.cli import main

sys.exit(main())
