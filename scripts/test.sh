#!/usr/bin/env bash
# The README's test command: installs what the tests need (Debian packages when missing, the
# project with its dev extras into the current Python), starts Redis if none listens, runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v docker-compose >/dev/null || missing+=(docker-compose)  # v1, for `config -q`
command -v espeak-ng >/dev/null || missing+=(espeak-ng)            # the demo's speech
command -v chromium >/dev/null || missing+=(chromium)              # the browser test
command -v chromedriver >/dev/null || missing+=(chromium-driver)
command -v haproxy >/dev/null || missing+=(haproxy)                # the replicas' load balancer
# Installers' own output goes to a log: one console line per step, and the log's tail on failure.
install_log="${TMPDIR:-/tmp}/hclip-install.log"
: >"$install_log"
step() {
    echo "$1 (log: $install_log)"
    shift
    if ! "$@" >>"$install_log" 2>&1; then
        echo "failed: $*; the end of $install_log:" >&2
        tail -n 20 "$install_log" >&2
        exit 1
    fi
}
if [ "${#missing[@]}" -gt 0 ]; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    step "updating the package lists" $sudo apt-get update -q
    step "installing Debian packages: ${missing[*]}" \
        $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# The service tests talk to a real Redis on 127.0.0.1:6379 (and start private ones of their own).
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
    redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
fi

step "installing the project with its dev and ray extras" python3 -m pip install -e '.[dev,ray]'
set +e
python3 -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$status"
