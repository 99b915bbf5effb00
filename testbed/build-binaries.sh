#!/usr/bin/env bash
# Builds the local test bed's binaries (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
# kwok, helm) from the pinned wrapper modules under testbed/go, and prints the folder that holds them.
#
# Binaries live in a cache outside the clone, keyed by a hash of the pins (every go.mod and go.sum, this script
# and the Go version), so a fresh clone on the same machine reuses them and a changed pin rebuilds them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${STRATA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/strata}
key=$( (cat "$here"/go/*/go.mod "$here"/go/*/go.sum "$0"; go version) | sha256sum | cut -c1-16)
out="$cache_root/bin/$key"

if [[ -f "$out/.complete" ]]; then
  echo "$out"
  exit 0
fi

log() { echo "build-binaries: $*" >&2; }

staging="$out.partial.$$"
rm -rf "$staging"
mkdir -p "$staging"
trap 'rm -rf "$staging"' EXIT

module_version() { # module_version DIR MODULE -> the version DIR's go.mod selects for MODULE
  (cd "$1" && go list -m -f '{{.Version}}' "$2")
}

export CGO_ENABLED=0
start=$SECONDS

kube_dir="$here/go/kubernetes"
kube_version=$(module_version "$kube_dir" k8s.io/kubernetes)
major=${kube_version#v}; minor=${major#*.}; major=${major%%.*}; minor=${minor%%.*}
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
  log "building $cmd $kube_version"
  (cd "$kube_dir" && go build -trimpath -ldflags "$kube_ldflags" -o "$staging/$cmd" "k8s.io/kubernetes/cmd/$cmd")
done

log "building etcd"
(cd "$here/go/etcd" && go build -trimpath -ldflags "-s -w" -o "$staging/etcd" go.etcd.io/etcd/server/v3)

kwok_version=$(module_version "$here/go/kwok" sigs.k8s.io/kwok)
log "building kwok $kwok_version"
(cd "$here/go/kwok" && go build -trimpath \
  -ldflags "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${kwok_version#v}" \
  -o "$staging/kwok" sigs.k8s.io/kwok/cmd/kwok)

# kwok simulates nothing without Stage objects; take the lifecycle stages the pinned kwok module itself ships
# (nodes initialise and renew their Lease; pods become ready, complete and delete).
kwok_stages=$(cd "$here/go/kwok" && go mod download -json sigs.k8s.io/kwok | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/kustomize/stage
for stage in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
             pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
  cat "$kwok_stages/$stage.yaml"
  echo "---"
done > "$staging/kwok-stages.yaml"

helm_version=$(module_version "$here/go/helm" helm.sh/helm/v3)
log "building helm $helm_version"
(cd "$here/go/helm" && go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$helm_version" \
  -o "$staging/helm" helm.sh/helm/v3/cmd/helm)

touch "$staging/.complete"
rm -rf "$out"
mv "$staging" "$out"
trap - EXIT
log "built in $((SECONDS - start)) s into $out"
echo "$out"
