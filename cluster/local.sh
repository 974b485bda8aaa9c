#!/usr/bin/env bash
# Start, stop and inspect a local Ray head that accepts `ray job submit`.
#
#   cluster/local.sh start     # start a head in the background; prints the env to use
#   cluster/local.sh env       # print `export ...` lines for clients (eval "$(... env)")
#   cluster/local.sh status    # `ray status` against this head
#   cluster/local.sh stop      # stop this head (and only this head)
#
# Ray 2.60 checks token authentication on the job API: a head started with
# RAY_AUTH_MODE=token rejects clients that do not send the token, and whether a head
# turns token auth on by itself depends on whether ~/.ray/auth_token happens to exist
# (`ray.init()` creates it).  So this script never leaves the mode to chance: it sets
# RAY_AUTH_MODE explicitly on the head and prints the same setting for clients.
#
#   KNAPSPEC_RAY_AUTH=token (default)  a random 256-bit token in $KNAPSPEC_RAY_DIR/auth_token
#                                      (mode 600), passed via RAY_AUTH_TOKEN_PATH; never
#                                      touches ~/.ray/auth_token
#   KNAPSPEC_RAY_AUTH=disabled         no authentication (a private machine only)
#
# Other settings (environment):
#   KNAPSPEC_RAY_DIR     state + Ray temp dir (default /tmp/knapspec-ray-$USER; keep it
#                        short: Ray puts Unix sockets under it)
#   RAY_PORT             GCS port (default 6379)
#   RAY_DASHBOARD_PORT   dashboard / job API port (default 8265)
#   RAY_CLIENT_PORT, RAY_AGENT_PORT   Ray Client server and dashboard agent ports (default
#                        10001 and 52365); set all four to run two heads on one machine
#   RAY_NUM_CPUS, RAY_NUM_GPUS   resources of the head (default: detected)
#
# The head runs `ray start --head --block` in the background; `stop` sends SIGTERM to that
# process, which shuts down its own GCS, raylet, dashboard and workers.  Unlike
# `ray stop`, it never touches other Ray instances on the machine.  Its own temp dir also
# keeps a plain `ray.init()` elsewhere on the machine from attaching to this head.
set -euo pipefail

STATE="${KNAPSPEC_RAY_DIR:-/tmp/knapspec-ray-${USER:-$(id -un)}}"
PORT="${RAY_PORT:-6379}"
DASH_PORT="${RAY_DASHBOARD_PORT:-8265}"
CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
AGENT_PORT="${RAY_AGENT_PORT:-52365}"
AUTH="${KNAPSPEC_RAY_AUTH:-token}"
PIDFILE="$STATE/head.pid"
TOKEN="$STATE/auth_token"
ENVFILE="$STATE/env.sh"
LOG="$STATE/head.log"
RAY="${RAY:-ray}"

die() { echo "local.sh: $*" >&2; exit 1; }

running() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

write_env() {
  {
    echo "export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASH_PORT  # ray job submit / SDK"
    echo "export RAY_ADDRESS=127.0.0.1:$PORT  # drivers: ray.init(), knapspec job"
    echo "export RAY_AUTH_MODE=$AUTH"
    if [[ "$AUTH" == token ]]; then
      echo "export RAY_AUTH_TOKEN_PATH=$TOKEN"
    else
      echo "unset RAY_AUTH_TOKEN_PATH"
    fi
  } >"$ENVFILE"
}

start() {
  if running; then
    echo "local.sh: a head is already running (pid $(cat "$PIDFILE")); env:" >&2
    cat "$ENVFILE"
    return 0
  fi
  case "$AUTH" in token | disabled) ;; *) die "KNAPSPEC_RAY_AUTH must be token or disabled, got '$AUTH'" ;; esac
  command -v "$RAY" >/dev/null || die "'$RAY' not found: activate the venv (. .venv/bin/activate)"
  mkdir -p "$STATE"
  chmod 700 "$STATE"
  local args=(start --head --block --temp-dir "$STATE/ray" --port "$PORT"
    --dashboard-host 127.0.0.1 --dashboard-port "$DASH_PORT" --include-dashboard true
    --ray-client-server-port "$CLIENT_PORT" --dashboard-agent-listen-port "$AGENT_PORT"
    --disable-usage-stats)
  [[ -n "${RAY_NUM_CPUS:-}" ]] && args+=(--num-cpus "$RAY_NUM_CPUS")
  [[ -n "${RAY_NUM_GPUS:-}" ]] && args+=(--num-gpus "$RAY_NUM_GPUS")
  export RAY_AUTH_MODE="$AUTH"
  if [[ "$AUTH" == token ]]; then
    if [[ ! -s "$TOKEN" ]]; then
      (umask 077 && python3 -c 'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN")
    fi
    export RAY_AUTH_TOKEN_PATH="$TOKEN"
  else
    unset RAY_AUTH_TOKEN_PATH RAY_AUTH_TOKEN
  fi
  write_env
  # setsid: the head must outlive this shell (and a test's process group).
  setsid nohup "$RAY" "${args[@]}" >"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  # Wait for the job API to answer (Ray startup takes ~10 s on 2 cores).
  local deadline=$((SECONDS + ${KNAPSPEC_RAY_START_TIMEOUT:-120}))
  # (any HTTP answer counts: with token auth an unauthenticated probe gets a 401).
  until grep -q "Ray runtime started" "$LOG" && [[ "$(curl -s -o /dev/null -w '%{http_code}' \
      "http://127.0.0.1:$DASH_PORT/api/version" 2>/dev/null)" =~ ^[1-5] ]]; do
    if ! running; then
      rm -f "$PIDFILE"
      tail -n 30 "$LOG" >&2
      die "ray start failed (log: $LOG)"
    fi
    ((SECONDS < deadline)) || { stop; die "the head did not come up within the timeout (log: $LOG)"; }
    sleep 0.5
  done
  echo "local.sh: Ray head up (pid $(cat "$PIDFILE"), dashboard http://127.0.0.1:$DASH_PORT," \
    "auth $AUTH); client env ($ENVFILE):" >&2
  cat "$ENVFILE"
}

stop() {
  if ! running; then
    rm -f "$PIDFILE"
    echo "local.sh: no head running for $STATE" >&2
    return 0
  fi
  local pid
  pid="$(cat "$PIDFILE")"
  kill -TERM "$pid"
  for _ in $(seq 1 60); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "local.sh: head pid $pid did not exit after SIGTERM; sending SIGKILL" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  # Anything of this head that outlived it (its temp dir names it) gets the same.
  local left
  left="$(pgrep -f -- "$STATE/ray" || true)"
  if [[ -n "$left" ]]; then
    kill -TERM $left 2>/dev/null || true
    sleep 2
    left="$(pgrep -f -- "$STATE/ray" || true)"
    [[ -n "$left" ]] && kill -KILL $left 2>/dev/null || true
  fi
  rm -f "$PIDFILE"
  echo "local.sh: head stopped" >&2
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  env)
    [[ -f "$ENVFILE" ]] || die "no head state in $STATE; run: cluster/local.sh start"
    cat "$ENVFILE"
    ;;
  status)
    running || die "no head running for $STATE"
    # shellcheck disable=SC1090
    source "$ENVFILE"
    "$RAY" status --address "127.0.0.1:$PORT"
    ;;
  *)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
