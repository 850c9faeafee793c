#!/usr/bin/env bash
# Renders each kustomize overlay given (default: all of deploy/overlays) and validates the result
# strictly against the Kubernetes schemas. Exits non-zero on the first overlay that fails.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
validate=${KUBERNETES_VALIDATE:-kubernetes-validate}
overlays=("$@")
[ ${#overlays[@]} -gt 0 ] || overlays=("$here"/overlays/*/)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for overlay in "${overlays[@]}"; do
  name=$(basename "$overlay")
  kubectl kustomize "$overlay" > "$tmp/$name.yaml"
  count=$(grep -c '^kind:' "$tmp/$name.yaml")
  "$validate" --strict --quiet "$tmp/$name.yaml"
  echo "$name: $count objects rendered and valid"
done
