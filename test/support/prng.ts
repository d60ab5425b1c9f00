/** A seeded PRNG (mulberry32), for tests that draw random inputs and print the seed to reproduce them. */
export function prng(seed: number) {
  let a = seed >>> 0
  const next = () => {
    a = (a + 0x6d2b79f5) | 0
    let t = Math.imul(a ^ (a >>> 15), 1 | a)
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }
  const r = {
    next,
    int: (n: number) => Math.floor(next() * n),
    range: (lo: number, hi: number) => lo + Math.floor(next() * (hi - lo + 1)),
    chance: (p: number) => next() < p,
    pick: <T>(items: readonly T[]): T => items[Math.floor(next() * items.length)],
    bytes: (n: number) => {
      const b = Buffer.allocUnsafe(n)
      for (let i = 0; i < n; i++) b[i] = (next() * 256) | 0
      return b
    },
    word: (n: number) => {
      let s = ''
      for (let i = 0; i < n; i++) s += String.fromCharCode(97 + r.int(26))
      return s
    },
  }
  return r
}
