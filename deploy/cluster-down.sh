#!/usr/bin/env bash
# Delete the quickstart's kind cluster (everything in it: KFP, the engine, MLflow and its
# volume). On an existing cluster (--existing), delete what cluster-up.sh added to the kubeflow
# namespace instead and leave the engine and KFP in place.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster=kubejax

if [ "${1:-}" = "--existing" ]; then
  kubectl delete -k "$here/kubejax" --ignore-not-found
  kubectl delete secret mlflow-credentials -n kubeflow --ignore-not-found
elif [ $# -gt 0 ]; then
  echo "cluster-down: unknown option $1 (only --existing)" >&2
  exit 2
else
  command -v kind > /dev/null || { echo "cluster-down: kind is required" >&2; exit 2; }
  kind delete cluster --name "$cluster"
fi
