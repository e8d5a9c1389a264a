# Sourced by llamacpp.sh, vllm.sh and guidellm.sh: ROOT (the repo), PY (the project venv's python), CACHE
# (--cache DIR, else $SPYRE_SERVE_PEERS_CACHE, else ~/.cache/spyre-serve/peers; created and
# made absolute) from the script's arguments, log and fresh_venv.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CACHE="${SPYRE_SERVE_PEERS_CACHE:-$HOME/.cache/spyre-serve/peers}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --cache) CACHE="$2"; shift 2 ;;
        --cache=*) CACHE="${1#--cache=}"; shift ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"
log() { echo "[$(basename "$0" .sh)] $*" >&2; }
# fresh_venv DIR SPEC...: a new venv at DIR (any old one removed) with the SPECs pip-installed.
fresh_venv() {
    local venv="$1"; shift
    log "creating $venv"
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    log "pip install $*"
    "$venv/bin/pip" install --quiet "$@"
}
