#!/usr/bin/env bash
# The container image, built from nothing and run as deploy/base/daemonset.yaml runs it (issue 15).
#
#   bash .ci/image.sh PYTHON      (PYTHON: an interpreter with densedev and pyyaml installed, for the
#                                  host side of the run checks: the kubelet emulator and the simulator)
#
# No registry is reachable from CI, so no base image can be pulled: both bases are made here from
# Debian packages with mmdebstrap (the mirror list is the machine's own apt sources), imported into
# podman, and the project's Dockerfile is built on them with --no-cache.  Then .ci/image_check.py runs
# the image with the DaemonSet's security context against a simulated node and the kubelet emulator,
# and in DRA mode as deploy/overlays/dra runs it, with the DRA kubelet emulator and the API-server
# stand-in (the same image: no second build).
# Needs root (as CI runs).  Every container and image made here carries the label below and is removed
# on exit, and at start too, in case an earlier run was killed before it could clean up
# (DENSEDEV_IMAGE_KEEP=1 keeps the images of a run for inspection; the next run still removes them).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${1:?usage: bash .ci/image.sh PYTHON}
LABEL=io.densedev.ci=image
BASE_BUILD=localhost/densedev-ci-base:build
BASE_RUNTIME=localhost/densedev-ci-base:runtime
IMAGE=localhost/densedev-ci:test
# A fixed work dir (not mktemp): a killed run's tree is found and removed by the next run.
WORK=/var/tmp/densedev-ci-image
SUITE=bookworm
# The machine's CA bundle: package indexes may be reached through a TLS-re-signing proxy, so the build's
# pip must trust what the machine trusts.  It is bind-mounted into RUN steps, never copied into a layer.
CA_BUNDLE=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}

t0=$SECONDS
step() { printf '== image: %s\n' "$*"; }
# A step's output goes to a log, printed only if the step fails.
quietly() {
    local log
    log=$(mktemp)
    "$@" > "$log" 2>&1 || { cat "$log" >&2; rm -f "$log"; return 1; }
    rm -f "$log"
}
elapsed() { echo $((SECONDS - $1)); }

if [ "$(id -u)" != 0 ]; then
    echo "image: needs root (mmdebstrap --mode=root, rootful podman, network namespaces)" >&2
    exit 2
fi

# --- tools ------------------------------------------------------------------------------------------
# Installed only when missing, and left installed: CI machines are fresh and thrown away, and on a
# developer's machine removing a podman they already had would be worse than keeping one we added.
missing=()
for tool in podman:podman runc:runc mmdebstrap:mmdebstrap; do
    command -v "${tool%%:*}" > /dev/null || missing+=("${tool#*:}")
done
install_s=0
if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]}"
    t=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    quietly apt-get update
    quietly apt-get install -y --no-install-recommends "${missing[@]}"
    install_s=$(elapsed "$t")
fi
[ -r "$CA_BUNDLE" ] || { echo "image: no CA bundle at $CA_BUNDLE (set SSL_CERT_FILE)" >&2; exit 2; }

# --- podman's configuration, for this script only (nothing on the host is changed) ------------------
mkdir -p "$WORK"
chmod 0700 "$WORK"
export CONTAINERS_CONF=$WORK/containers.conf
# runc, not crun: crun refuses this machine's hybrid cgroup v1/v2 layout.  cgroupfs and a file event log:
# there is no systemd or journald to talk to.  Explicit ulimits: root here has no CAP_SYS_RESOURCE, so
# runc cannot raise a hard limit, and podman's default (nofile 1048576) fails every container start.
# nofile: this shell's hard limit.  nproc: at most 32768, the hard limit podman 4.3 leaves its conmon
# and runc with (seen in /proc/<conmon>/limits), even where the shell's is higher.
nofile=$(ulimit -Hn)
nproc=$(ulimit -Hu)
[ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ] && nproc=32768
[ "$nofile" = unlimited ] && nofile=1048576
cat > "$CONTAINERS_CONF" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF

cleanup() {
    local ids
    ids=$(podman ps -aq --filter "label=$LABEL" 2> /dev/null || true)
    [ -z "$ids" ] || podman rm -f -t 0 $ids > /dev/null 2>&1 || true
    ids=$(podman images -q --filter "label=$LABEL" 2> /dev/null | sort -u || true)
    [ -z "$ids" ] || podman rmi -f $ids > /dev/null 2>&1 || true
    # A run killed inside mmdebstrap leaves proc, sys and dev mounted in its tree: unmount them, deepest
    # first, and never let rm cross into another file system (it would reach the host's /dev).
    awk -v w="$WORK/" 'index($5, w) == 1 { print $5 }' /proc/self/mountinfo | sort -r | xargs -r -n1 umount -l
    rm -rf --one-file-system "$WORK/root" "$WORK/check"
}
on_exit() {
    local rc=$?
    if [ "${DENSEDEV_IMAGE_KEEP:-}" = 1 ]; then
        step "kept the images labelled $LABEL (DENSEDEV_IMAGE_KEEP=1); the next run removes them"
        exit $rc
    fi
    step "cleaning up (containers and images labelled $LABEL, $WORK)"
    cleanup
    rm -rf --one-file-system "$WORK"
    exit $rc
}
cleanup
trap on_exit EXIT

# --- base images from Debian packages --------------------------------------------------------------
# One mmdebstrap run makes the build base (python3-dev for Python.h; the Dockerfile's build stage adds
# gcc); the runtime base is the same tree after purging the headers and what only they pulled in.
# --variant=apt: Essential packages + apt (apt-get is run by the Dockerfile's build stage).
# merged-usr hook: without it apt pulls in usrmerge and ~50 MB of perl.  Docs and locales excluded.
# /opt/venv: `python` and `pip` then behave as in the official Python images the Dockerfile defaults to.
# dpkg's force-unsafe-io (no fsync per unpacked file) only while this throw-away tree is made: a crash
# here means a rebuild anyway; the option is removed before the tree becomes an image.
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -s "$f" ] && sources+=("$f")
done
[ ${#sources[@]} -gt 0 ] || { echo "image: no apt sources on this machine" >&2; exit 2; }

step "base: mmdebstrap $SUITE (mirrors from ${sources[*]})"
t=$SECONDS
quietly mmdebstrap --variant=apt --mode=root --format=directory \
    --include=python3,python3-venv,python3-dev,ca-certificates \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --setup-hook='mkdir -p "$1/etc/dpkg/dpkg.cfg.d" && echo force-unsafe-io > "$1/etc/dpkg/dpkg.cfg.d/ci-unsafe-io"' \
    --customize-hook='rm "$1/etc/dpkg/dpkg.cfg.d/ci-unsafe-io"' \
    --customize-hook='chroot "$1" python3 -m venv /opt/venv' \
    --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname" "$1"/var/cache/apt/*.bin' \
    "$SUITE" "$WORK/root" "${sources[@]}"

import_base() {
    # The tree's /dev, /proc and /sys stay empty: the runtime provides them.
    tar -C "$WORK/root" --numeric-owner --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
        | podman import --quiet \
            --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change "LABEL $LABEL" --change 'CMD ["python"]' - "$1" > /dev/null
}
import_base "$BASE_BUILD"
# Offline purge (dpkg only).  The venv's own pip stays: it is files of /opt/venv, not of a package.
quietly chroot "$WORK/root" apt-get purge -y --autoremove python3-dev python3-venv ca-certificates
import_base "$BASE_RUNTIME"
rm -rf --one-file-system "$WORK/root"
base_s=$(elapsed "$t")

# --- the image ------------------------------------------------------------------------------------
# --no-cache: podman 4.3 reused a stale layer holding the old wheel after a source change, and fails
# with "couldn't find .../wheels" when the build stage is cached but the runtime step is not.
# --layers=false: no intermediate images are kept, so nothing unlabelled is left behind.
# --network=host: RUN steps reach the mirror and PyPI as the host does, with no bridge or NAT to set up.
version=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
revision=$(git rev-parse HEAD 2> /dev/null || echo unknown)
source_url=$(git config --get remote.origin.url 2> /dev/null || true)
step "build: podman build --no-cache (build base $BASE_BUILD, runtime base $BASE_RUNTIME)"
t=$SECONDS
podman build --quiet --no-cache --layers=false --network=host \
    --volume "$CA_BUNDLE:/etc/ssl/certs/ca-certificates.crt:ro" \
    --build-arg BUILD_IMAGE="$BASE_BUILD" --build-arg RUNTIME_IMAGE="$BASE_RUNTIME" \
    --build-arg VERSION="$version" --build-arg REVISION="$revision" --build-arg SOURCE="$source_url" \
    --label "$LABEL" -t "$IMAGE" -f Dockerfile . > /dev/null
build_s=$(elapsed "$t")

# --- what the image holds -------------------------------------------------------------------------
size_mb() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f", $1 / 1e6}'; }
label() { podman image inspect --format "{{index .Labels \"org.opencontainers.image.$2\"}}" "$1"; }
fail() { echo "image: FAILED: $*" >&2; exit 1; }
t=$SECONDS

[ "$(label "$IMAGE" version)" = "$version" ] || fail "label version is '$(label "$IMAGE" version)', not $version"
[ "$(label "$IMAGE" revision)" = "$revision" ] || fail "label revision is not $revision"
[ "$(label "$IMAGE" source)" = "$source_url" ] || fail "label source is not '$source_url'"

mnt=$(podman image mount "$IMAGE")
# The runtime carries no compiler and no system or Python C headers (the build stage had both; wheels
# may ship a header of their own, e.g. grpcio's, which is not what this is about).
toolchain=$(find "$mnt" -xdev \( -path '*/bin/*' \( -name '*gcc*' -o -name cc \) \
    -o -path "$mnt/usr/include/*" -name '*.h' -o -path "$mnt/usr/local/include/*" -name '*.h' \) \
    -print | sed "s|^$mnt||" | head -5)
[ -z "$toolchain" ] || { podman image unmount "$IMAGE" > /dev/null; fail "runtime image holds $toolchain"; }
# The CA bundle was mounted into the build, never copied: no file of the image has its exact bytes.
ca_size=$(stat -c %s "$CA_BUNDLE")
copies=$(find "$mnt" -xdev -type f -size "${ca_size}c" -exec cmp -s "$CA_BUNDLE" {} \; -print | sed "s|^$mnt||")
podman image unmount "$IMAGE" > /dev/null
[ -z "$copies" ] || fail "the build's CA bundle was copied into the image: $copies"

# The image's command answers as any user (non-root-friendly layout: nothing root-only to read) and
# reports the compiled extension.
for user in 0:0 65534:65534; do
    out=$(podman run --rm --label "$LABEL" --read-only --cap-drop=ALL --security-opt=no-new-privileges \
        --network=none --user "$user" "$IMAGE" --version)
    case "$out" in
        "densedev $version (cython"*) echo "image: --version as $user: $out" ;;
        *) fail "--version as $user printed '$out'" ;;
    esac
done

inspect_s=$(elapsed "$t")

# --- run it as the DaemonSet does ---------------------------------------------------------------
step "run: the DaemonSet's container against a simulated node and the kubelet emulator"
t=$SECONDS
mkdir -p "$WORK/check"
# The DRA mode runs deploy/overlays/dra's DaemonSet as a cluster would receive it, rendered by kubectl's
# kustomize (as tests/test_deploy.py renders every overlay), beside the API-server stand-in and the DRA
# kubelet emulator.  Without kubectl that run is skipped with a line saying so, except under CI.
dra=()
if command -v kubectl > /dev/null; then
    kubectl kustomize deploy/overlays/dra > "$WORK/dra.yaml"
    dra=(--dra-manifest "$WORK/dra.yaml")
elif [ "${CI:-}" = true ]; then
    fail "kubectl is needed to render deploy/overlays/dra for the DRA-mode run"
else
    echo "image: DRA-mode run skipped: no kubectl to render deploy/overlays/dra" >&2
fi
# Then the SR-IOV network device plugin's own DaemonSet, the SR-IOV network operator's and the RDMA shared
# device plugin's, with only the image swapped (issue 24): densedev must take their command lines and
# volume layouts as they are.
"$PY" .ci/image_check.py --engine podman --image "$IMAGE" --label "$LABEL" \
    --manifest deploy/base/daemonset.yaml "${dra[@]}" \
    --go-plugin-manifest .ci/daemonsets/sriov-network-operator.yaml \
    --go-plugin-manifest .ci/daemonsets/sriovdp-daemonset.yaml \
    --rdma-plugin-manifest .ci/daemonsets/rdma-shared-dev-plugin.yaml --work "$WORK/check"
run_s=$(elapsed "$t")

printf 'image: install %s s; base images %s s (build %s MB, runtime %s MB); image build %s s (%s MB); ' \
    "$install_s" "$base_s" "$(size_mb "$BASE_BUILD")" "$(size_mb "$BASE_RUNTIME")" "$build_s" "$(size_mb "$IMAGE")"
printf 'labels, contents and --version %s s; run checks %s s; total %s s before clean-up\n' \
    "$inspect_s" "$run_s" "$(elapsed "$t0")"
