#!/usr/bin/env bash
# The PostgreSQL floor of a consumer transaction, per design, with pgbench:
#   bare       BEGIN; the handler's insert; COMMIT (3 round trips, 1 row)
#   dedup      + the processed_events insert, pipelined with BEGIN (2 rows)
#   eventline  + eventline's admission instead: processed_events and the
#              aggregate_versions upsert in one statement (3 rows)
#   onerow     the version kept on the processed_events row, the aggregate's
#              last version read through a unique index on it (2 rows)
# Designs take turns, ROUNDS rounds of SECONDS each at CLIENTS clients, the
# schema recreated before each turn. Prints transactions/s per design and
# "ratio floor_<design>_vs_bare=" lines (the means over the rounds).
set -euo pipefail
cd "$(dirname "$0")"
URL=${1:-${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test?sslmode=disable}}
ROUNDS=${ROUNDS:-2} SECONDS_EACH=${SECONDS_EACH:-12} CLIENTS=${CLIENTS:-16}
PGBENCH=${PGBENCH:-$(ls /usr/lib/postgresql/*/bin/pgbench 2>/dev/null | tail -1)}
designs=(bare dedup eventline onerow)
declare -A sum
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for ((r = 1; r <= ROUNDS; r++)); do
	order=("${designs[@]}")
	((r % 2 == 0)) && order=($(printf '%s\n' "${designs[@]}" | tac))
	for d in "${order[@]}"; do
		psql -q -X -v ON_ERROR_STOP=1 "$URL" -f setup.sql >/dev/null
		tps=$("$PGBENCH" -n -M prepared --random-seed=rand -c "$CLIENTS" -j 2 -T "$SECONDS_EACH" -f "$d.sql" "$URL" 2>&1 |
			awk '/^tps/ {print $3}')
		echo "round $r $d ${tps:-failed} tx/s" >&2
		sum[$d]=$(awk -v a="${sum[$d]:-0}" -v b="${tps:-0}" 'BEGIN {print a + b}')
	done
done
psql -q -X "$URL" -c 'DROP SCHEMA pgmin CASCADE' >/dev/null 2>&1
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
printf '%-10s %10s\n' DESIGN 'TX/S'
for d in "${designs[@]}"; do printf '%-10s %10.0f\n' "$d" "$(awk -v s="${sum[$d]}" -v n="$ROUNDS" 'BEGIN {print s / n}')"; done
for d in dedup eventline onerow; do
	awk -v a="${sum[$d]}" -v b="${sum[bare]}" -v d="$d" 'BEGIN {printf "ratio floor_%s_vs_bare=%.2f\n", d, a / b}'
done
