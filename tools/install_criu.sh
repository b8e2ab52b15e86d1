#!/usr/bin/env bash
# Install CRIU >= 4.1 for `ember snapshot`, idempotently (Debian 12, root).
#
# Debian 12 ships CRIU 3.17, which cannot dump processes on kernels >= 6.13 (they add a [vvar_vclock]
# mapping it does not know). This script builds CRIU 4.1.1 from Debian trixie's source archive with
# build dependencies from Debian, installs the binary as /usr/local/sbin/criu, and installs iptables
# (CRIU uses it for --tcp-established). Nothing happens when a CRIU >= 4.1 is already on PATH.
#
#   tools/install_criu.sh            install if needed
#   CRIU_PREFIX=/opt/criu tools/install_criu.sh
set -euo pipefail

VERSION=4.1.1
SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
PREFIX=${CRIU_PREFIX:-/usr/local}
BUILD_ROOT=${CRIU_BUILD_DIR:-/var/cache/ember-criu}

have_criu() {
    local v
    v=$(criu --version 2>/dev/null | sed -n 's/^Version: *//p') || return 1
    [ -n "$v" ] || return 1
    # True when v >= 4.1.
    [ "$(printf '%s\n4.1\n' "$v" | sort -V | head -n 1)" = "4.1" ]
}

if have_criu && command -v iptables >/dev/null; then
    echo "criu $(criu --version | sed -n 's/^Version: *//p') already installed"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install_criu.sh: CRIU must be installed as root" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "install_criu.sh: needs a Debian-based system (apt-get); install CRIU >= 4.1 by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
DEPS="build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler
      python3-protobuf libnl-3-dev libnet1-dev libcap-dev libaio-dev libgnutls28-dev libnftables-dev
      libbsd-dev uuid-dev iptables xz-utils"
SRC_LIST=/etc/apt/sources.list.d/ember-criu-trixie-src.sources
if [ ! -f "$SRC_LIST" ]; then
    cat > "$SRC_LIST" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
fi
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $DEPS >/dev/null

have_criu && { echo "criu already installed; iptables added"; exit 0; }

mkdir -p "$BUILD_ROOT"
cd "$BUILD_ROOT"
TARBALL=criu_${VERSION}.orig.tar.xz
if ! echo "$SHA256  $TARBALL" | sha256sum -c --status 2>/dev/null; then
    rm -f "$TARBALL"
    # Only the .orig tarball is served for this version; apt-get exits non-zero for the missing
    # .dsc, so success is judged by the checksum of what arrived.
    apt-get source --download-only "criu=${VERSION}-1" >/dev/null 2>&1 || true
    echo "$SHA256  $TARBALL" | sha256sum -c --status || {
        echo "install_criu.sh: could not fetch $TARBALL from Debian trixie sources" >&2
        exit 1
    }
fi
rm -rf "criu-$VERSION"
tar xf "$TARBALL"
make -C "criu-$VERSION" -j"$(nproc)" criu >/dev/null
install -D -m 0755 "criu-$VERSION/criu/criu" "$PREFIX/sbin/criu"
hash -r
have_criu || { echo "install_criu.sh: built criu does not report version >= 4.1" >&2; exit 1; }
criu check >/dev/null 2>&1 || echo "install_criu.sh: warning: 'criu check' reports problems on this kernel" >&2
echo "criu $(criu --version | sed -n 's/^Version: *//p') installed at $PREFIX/sbin/criu"
