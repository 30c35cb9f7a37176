"""kubejax's KFP v2 components. Each is a short KFP definition over tested library code.

All run on the one kubejax image (`kubejax.version.IMAGE`) with nothing to install at run time
(`install_kfp_package=False`), so they work on air-gapped clusters.
"""

from kubejax.components.evaluate import evaluate
from kubejax.components.prepare import prepare_yelp
from kubejax.components.register import register_model
from kubejax.components.train import train
from kubejax.components.tune import tune_sweep

__all__ = ["evaluate", "prepare_yelp", "register_model", "train", "tune_sweep"]
