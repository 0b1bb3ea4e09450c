"""``python -m lossscale.demo``."""

from lossscale.demo import main

main()
