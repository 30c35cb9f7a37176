# shellcheck shell=bash
# Sourced by bench/tpu.sh and the TPU attempts' commands: the trainer's packages from the TPU
# machine's own index, beside its JAX (which stays first on the path), and kubejax's source.
site=${KUBEJAX_TPU_SITE:-/tmp/site}
if [ ! -d "$site/flax" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target "$site" flax==0.12.8 optax==0.2.8 \
    'orbax-checkpoint>=0.12,<0.13' safetensors tokenizers pyarrow pandas psutil pyyaml tqdm \
    'ml-dtypes>=0.5,<0.7'
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site:$PWD/src:$PWD"
export PYTHONUNBUFFERED=1
