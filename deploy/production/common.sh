# Read by every step: the site, and this host's name and address in it.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/site.env"
release=$(cd "$here/../.." && pwd)
me=$(hostname -s)
addr_of() { local h; for h in $REDIS_HOSTS $GATEWAY_HOSTS $EDGE_HOST; do
  [ "${h%%=*}" = "$1" ] && { echo "${h#*=}"; return; }; done; echo "unknown host $1" >&2; return 1; }
names_of() { local h; for h in $1; do echo "${h%%=*}"; done; }
# Every host's name in /etc/hosts, once (skip it where DNS already has them).
hosts_file() { local h; for h in $REDIS_HOSTS $GATEWAY_HOSTS $EDGE_HOST; do
  grep -q " ${h%%=*}.$PET_DOMAIN\$" /etc/hosts || echo "${h#*=} ${h%%=*}.$PET_DOMAIN" >> /etc/hosts; done; }
