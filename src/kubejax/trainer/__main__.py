"""`python -m kubejax.trainer`: the program every JAXJob worker runs."""

import sys

from kubejax.trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
