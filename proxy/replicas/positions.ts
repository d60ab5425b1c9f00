/** Positions in the WAL as the proxy reads and tells them (their text: src/positions.ts). */

/** An LSN as a number (`X/Y`, each 32 bits in hex); undefined if it is none. */
export function lsn(text: string): bigint | undefined {
  const m = /^([0-9A-Fa-f]{1,8})\/([0-9A-Fa-f]{1,8})$/.exec(text)
  return m ? (BigInt(parseInt(m[1], 16)) << 32n) | BigInt(parseInt(m[2], 16)) : undefined
}

export const lsnText = (n: bigint) => `${(n >> 32n).toString(16).toUpperCase()}/${(n & 0xffffffffn).toString(16).toUpperCase()}`

/** The position a client says it has seen of `database` (0 if none), from its positions' text (at most 1 KiB read). */
export function positionOf(text: string | undefined, database: string): bigint {
  for (const part of (text ?? '').slice(0, 1024).split(',')) {
    const [id, at] = part.trim().split(':')
    if (id === database) return lsn(at ?? '') ?? 0n
  }
  return 0n
}
