"""kubejax: train and tune JAX/Flax BERT classifiers on Kubeflow (KFP v2, JAXJob, MLflow)."""

from kubejax.version import IMAGE, __version__

__all__ = ["IMAGE", "__version__"]
