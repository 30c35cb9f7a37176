#!/usr/bin/env bash
# From nothing to a kubejax pipeline run on a kind cluster (or on the current kubectl context
# with --existing): a training engine, Kueue with a queue, KFP standalone, an MLflow server, the
# launcher's RBAC, the MLflow credentials secret, the kubejax image, then one pipeline run whose
# jobs wait in the Kueue queue.
#
#   deploy/cluster-up.sh                                  # Kubeflow Trainer v2 (TrainJob)
#   deploy/cluster-up.sh --engine training-operator       # Training Operator v1.9 (JAXJob)
#   deploy/cluster-up.sh --existing --gpu --image REGISTRY/kubejax:TAG
#
# Needs docker, kind (unless --existing), kubectl, and `kubejax` (make demo installs it in
# .venv). Every version comes from deploy/versions.env.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"

engine=trainer
gpu=false
existing=false
submit=true
cluster=kubejax
version="$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$root/src/kubejax/version.py")"
image="ghcr.io/kubejax/kubejax:$version"
kubejax="${KUBEJAX:-$root/.venv/bin/kubejax}"

usage() {
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-0}"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --engine) engine="${2:?--engine needs trainer or training-operator}"; shift 2 ;;
    --gpu) gpu=true; shift ;;
    --existing) existing=true; shift ;;
    --image) image="${2:?--image needs REGISTRY/NAME:TAG}"; shift 2 ;;
    --no-submit) submit=false; shift ;;
    -h | --help) usage 0 ;;
    *) echo "cluster-up: unknown option $1" >&2; usage 2 ;;
  esac
done
case "$engine" in
  trainer | training-operator) ;;
  *) echo "cluster-up: --engine must be trainer or training-operator, got $engine" >&2; exit 2 ;;
esac

need() {
  command -v "$1" > /dev/null || { echo "cluster-up: $1 is required ($2)" >&2; exit 2; }
}
need docker "https://docs.docker.com/engine/install/"
need kubectl "https://kubernetes.io/docs/tasks/tools/"
$existing || need kind "https://kind.sigs.k8s.io/docs/user/quick-start/#installation"
[ -x "$kubejax" ] || { echo "cluster-up: $kubejax not found: run make demo first, or set KUBEJAX" >&2; exit 2; }

step() { printf '\n== %s\n' "$*"; }

# Retry a command that fails while a webhook or CRD it needs is still starting.
retry() {
  local attempt
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    if "$@"; then return 0; fi
    echo "   (attempt $attempt failed; retrying in 15 s)"
    sleep 15
  done
  return 1
}

if ! $existing; then
  step "kind cluster '$cluster' ($KIND_NODE_IMAGE)"
  if kind get clusters | grep -qx "$cluster"; then
    echo "   exists; reusing it"
  else
    kind create cluster --name "$cluster" --image "$KIND_NODE_IMAGE" --config "$here/kind-config.yaml"
  fi
  kubectl config use-context "kind-$cluster"
fi

if [ "$engine" = trainer ]; then
  step "Kubeflow Trainer $TRAINER_VERSION (JobSet included), its runtimes and kubejax's jax-tpu"
  base="https://github.com/kubeflow/trainer.git/manifests/overlays"
  kubectl apply --server-side -k "$base/manager?ref=$TRAINER_VERSION"
  kubectl wait --for=condition=Available deployment --all -n kubeflow-system --timeout=10m
  retry kubectl apply --server-side -k "$base/runtimes?ref=$TRAINER_VERSION"
  kubectl get clustertrainingruntime jax-distributed
  # kubejax's runtime for TPU slices (GKE); unused, and harmless, on a cluster without TPUs.
  retry kubectl apply --server-side -f "$here/trainer/jax-tpu.yaml"
else
  step "Kubeflow Training Operator $TRAINING_OPERATOR_VERSION (JAXJob)"
  kubectl apply --server-side \
    -k "github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=$TRAINING_OPERATOR_VERSION"
  kubectl wait --for=condition=Available deployment/training-operator -n kubeflow --timeout=10m
fi

step "Kueue $KUEUE_VERSION (TrainJob and JAXJob integrations)"
kubectl apply --server-side \
  -f "https://github.com/kubernetes-sigs/kueue/releases/download/$KUEUE_VERSION/manifests.yaml"
kubectl create configmap kueue-manager-config -n kueue-system \
  --from-file=controller_manager_config.yaml="$here/kueue/controller_manager_config.yaml" \
  --dry-run=client -o yaml | kubectl apply -f -
kubectl rollout restart deployment/kueue-controller-manager -n kueue-system
kubectl rollout status deployment/kueue-controller-manager -n kueue-system --timeout=10m

step "Kubeflow Pipelines $KFP_VERSION (standalone, with a default workspace volume)"
kubectl apply -k "github.com/kubeflow/pipelines/manifests/kustomize/cluster-scoped-resources?ref=$KFP_VERSION"
kubectl wait --for=condition=established --timeout=2m crd/applications.app.k8s.io
retry kubectl apply -k "$here/kfp"

step "The kubejax Kueue queue (ClusterQueue and LocalQueue kubejax in namespace kubeflow)"
retry kubectl apply --server-side -f "$here/kueue/queues.yaml"

step "kubejax image $image"
variant=cpu
$gpu && variant=cuda
docker build -f "$root/trainer_image/Dockerfile" --build-arg "JAX_VARIANT=$variant" -t "$image" "$root"
if $existing; then
  docker push "$image"
else
  kind load docker-image "$image" --name "$cluster"
fi

step "MLflow credentials secret (random password; never in a file or a parameter)"
if ! kubectl get secret mlflow-credentials -n kubeflow > /dev/null 2>&1; then
  password="$(head -c 32 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c 24)"
  kubectl create secret generic mlflow-credentials -n kubeflow \
    --from-literal=username=admin --from-literal=password="$password"
  unset password
fi

step "MLflow server and the launcher's RBAC"
kubectl kustomize "$here/kubejax" \
  | sed "s#ghcr.io/kubejax/kubejax:$version#$image#" \
  | kubectl apply -f -
kubectl rollout status deployment/mlflow -n kubeflow --timeout=10m
kubectl wait --for=condition=Available deployment --all -n kubeflow --timeout=20m

if $submit; then
  step "A pipeline run (kubejax-yelp, a small budget for a $([ "$gpu" = true ] && echo GPU || echo CPU) cluster)"
  kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80 > /dev/null 2>&1 &
  forward=$!
  trap 'kill "$forward" 2> /dev/null || true' EXIT
  sleep 5
  params=(
    --param "image=$image"
    --param "mlflow_tracking_uri=http://mlflow.kubeflow.svc.cluster.local:5000"
    --param "base_model=sentence-transformers/all-MiniLM-L6-v2"
    --param "max_length=128"
    --param "max_train_samples=5000"
    --param "max_validation_samples=1000"
    --param "max_test_samples=2000"
    --param "queue_name=kubejax"
  )
  if $gpu; then
    params+=(
      --param "gpus_per_worker=1" --param "trial_gpus_per_worker=1"
      --param 'worker_node_selector={"nvidia.com/gpu.present": "true"}'
      --param 'worker_tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]'
    )
  else
    params+=(--param "gpus_per_worker=0" --param "trial_gpus_per_worker=0" --param "replicas=1")
  fi
  "$kubejax" submit --host http://localhost:8080 --pipeline kubejax-yelp "${params[@]}"
fi

cat <<EOF

kubejax is up ($engine engine).
  KFP UI:     kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80   → http://localhost:8080
  MLflow UI:  kubectl port-forward -n kubeflow svc/mlflow 5000:5000         → http://localhost:5000
              user admin, password: kubectl get secret mlflow-credentials -n kubeflow \\
                                      -o jsonpath='{.data.password}' | base64 -d
  Clean up:   deploy/cluster-down.sh
EOF
