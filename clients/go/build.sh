#!/bin/sh
# Builds meshgo (clients/go/meshgo) against the contract: Go code generated from proto/ by
# protoc-gen-go and protoc-gen-go-grpc (run through grpcio-tools' protoc, whose well-known
# types it includes), compiled in GOPATH mode against the Go packages of GO_DEPS (Debian's
# golang-google-grpc-dev, with the golang-google-genproto-dev it depends on, and
# golang-google-protobuf-dev install them in /usr/share/gocode). The compiled packages go to
# Go's own build cache (GOCACHE, by default in the user's cache folder), which every build of
# it shares: compiling gRPC's Go packages takes some 30 s of CPU the first time; each build
# after compiles only what changed. Without a user cache folder it can write to, WORK/cache.
#
#   clients/go/build.sh [OUTPUT]      (default clients/go/bin/meshgo)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${1:-$here/bin/meshgo}
work=${GO_BUILD_DIR:-$here/.build}
python=${PYTHON:-$root/.venv/bin/python}
deps=${GO_DEPS:-/usr/share/gocode}
cache=$(go env GOCACHE 2>/dev/null || true)
case "$cache" in "" | off) cache="$work/cache" ;; esac
mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || cache="$work/cache"

gen="$work/src/agentmesh/gen"
rm -rf "$work/src/agentmesh"
mkdir -p "$gen" "$(dirname "$out")"
maps=""
for proto in "$root"/proto/mesh/v1/*.proto; do
  maps="$maps,Mmesh/v1/$(basename "$proto")=agentmesh/gen/mesh/v1;meshv1"
done
maps=${maps#,}
wkt=$("$python" -c 'import grpc_tools, os; print(os.path.join(os.path.dirname(grpc_tools.__file__), "_proto"))')
"$python" -m grpc_tools.protoc -I "$root/proto" -I "$wkt" \
  --go_out="$work/src" --go_opt="$maps" \
  --go-grpc_out="$work/src" --go-grpc_opt="$maps" \
  "$root"/proto/mesh/v1/*.proto
cp -R "$here/meshgo" "$work/src/agentmesh/meshgo"
cd "$work/src/agentmesh/meshgo"
GOPATH="$work:$deps" GO111MODULE=off GOFLAGS= GOCACHE="$cache" go vet .
GOPATH="$work:$deps" GO111MODULE=off GOFLAGS= GOCACHE="$cache" go build -o "$out" .
