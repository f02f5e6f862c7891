#!/usr/bin/env bash
# Installs redis-server from Debian's packages when it is missing (CI runs as root).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq redis-server >/dev/null
# The package starts a system instance on 6379; the tests start their own on a free port.
($SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1) || true
command -v redis-server
