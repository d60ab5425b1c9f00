/**
 * Positions in a database's write-ahead log, as the driver carries them (`config.lastWrite`) and
 * edgepg-proxy tells them: `<system identifier>:<LSN>` (the cluster, as pg_control_system() names
 * it, then a position as Postgres prints one, `16/B374D848`), comma-separated, one per database. A
 * standby shares its primary's identifier, so a position names where it holds.
 */
const POSITION = /^(\d{1,20}):([0-9A-F]{1,8})\/([0-9A-F]{1,8})$/

/** Both strings' positions, each database's later one (what is not a position is left out). */
export function later(a = '', b = ''): string {
  const by = new Map<string, [string, string]>()
  for (const part of `${a},${b}`.toUpperCase().split(',')) {
    const m = POSITION.exec(part.trim())
    // (Each half padded to 8 digits: then text compares as the number does.)
    const at = m && m[2].padStart(8, '0') + m[3].padStart(8, '0')
    if (at && !((by.get(m[1])?.[0] ?? '') >= at)) by.set(m[1], [at, m[0]])
  }
  return [...by.values()].map(([, p]) => p).join(',')
}
