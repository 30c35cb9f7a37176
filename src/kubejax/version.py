"""The one version of kubejax; the trainer image tag is derived from it."""

__version__ = "0.1.0"

#: Registry path of the image that every component and JAXJob worker runs.
IMAGE_REPOSITORY = "ghcr.io/kubejax/kubejax"
#: The image tag that matches this package version.
IMAGE = f"{IMAGE_REPOSITORY}:{__version__}"
