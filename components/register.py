"""The `register-model` component: the MLflow model into the Model Registry."""

from kfp import dsl
from kfp.dsl import Artifact, Input

from kubejax.version import IMAGE


@dsl.component(base_image=IMAGE, install_kfp_package=False)
def register_model(
    mlflow_model: Input[Artifact], model_name: str, mlflow_tracking_uri: str = ""
) -> str:
    """Register a logged MLflow model under `model_name`.

    Args:
        mlflow_model: evaluate's mlflow_model output (JSON with the model's URI).
        model_name: Name in the Model Registry.
        mlflow_tracking_uri: MLflow tracking URI; empty uses $MLFLOW_TRACKING_URI.

    Returns:
        The new model version.
    """
    import json

    from kubejax import tracking

    with open(mlflow_model.path) as f:
        model_uri = json.load(f)["model_uri"]
    if not model_uri:
        raise ValueError("model_uri: empty (evaluate logged no model: is MLflow configured?)")
    version = tracking.register_model(mlflow_tracking_uri, model_uri, model_name)
    print(f"registered {model_uri} as {model_name} version {version}")
    return version
