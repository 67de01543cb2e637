import sys

from zpp_jax.cli import main

sys.exit(main())
