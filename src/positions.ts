/**
 * Positions in a database's write-ahead log, as the driver carries them (`config.lastWrite`) and
 * edgepg-proxy reads and tells them: `<system identifier>:<LSN>` (the cluster Postgres names in
 * pg_control_system(), then a position as Postgres prints one, `16/B374D848`), comma-separated, one
 * per database. A standby shares its primary's identifier, so a position names where it holds.
 */

/** An LSN as a number (`X/Y`, each 32 bits in hex); undefined if it is none. */
export function lsn(text: string): bigint | undefined {
  const m = /^([0-9A-Fa-f]{1,8})\/([0-9A-Fa-f]{1,8})$/.exec(text)
  return m ? (BigInt(`0x${m[1]}`) << 32n) | BigInt(`0x${m[2]}`) : undefined
}

export const lsnText = (n: bigint) => `${(n >> 32n).toString(16).toUpperCase()}/${(n & 0xffffffffn).toString(16).toUpperCase()}`

/** Most databases a string of positions keeps (the latest written first); more are dropped. */
const MAX_DATABASES = 16

/** The positions a string holds, by database; what is not a position is left out. */
export function positions(text: string | undefined): Map<string, bigint> {
  const by = new Map<string, bigint>()
  for (const part of (text ?? '').split(',')) {
    const at = part.indexOf(':')
    const id = part.slice(0, at).trim()
    const n = lsn(part.slice(at + 1).trim())
    if (at > 0 && /^\d{1,20}$/.test(id) && n !== undefined && by.size < MAX_DATABASES) by.set(id, (by.get(id) ?? 0n) > n ? by.get(id)! : n)
  }
  return by
}

/** Both strings' positions, each database's later one: what reads must not go behind. */
export function later(a: string | undefined, b: string | undefined): string {
  const by = positions(a)
  for (const [id, n] of positions(b)) if (n > (by.get(id) ?? -1n)) by.set(id, n)
  return [...by].map(([id, n]) => `${id}:${lsnText(n)}`).join(',')
}
